"""Where ernie-deploy's files live on a host, and how a host reaches its own instances.

Plain values in a pure module, so every side that names a host path reads it here: the renderer (where units
and env files go), the remote scripts, and the exported Ansible role's host program, which export/program.py
fills in from here (export/ may not import remote/).
"""

from __future__ import annotations

UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ernie-deploy"
STATE_DIR = "/var/lib/ernie-deploy"  # ernie-deploy's own record: root-owned, mode 0700 below it
LOCK_DIR = f"{STATE_DIR}/lock"  # the deploy lock: an atomic mkdir plus its details file (remote/lock.py)
RELEASES_DIR = f"{STATE_DIR}/releases"
STAGING_DIR = f"{STATE_DIR}/staging"
# Units whose files were staged but not activated yet: a later run restarts them even though their files
# already match, so a stage without its activate never reads as "nothing to change".
PENDING_FILE = f"{STATE_DIR}/pending"
# Used GPU memory per GPU right before each unit last started: the release gate waits for it after a stop.
BASELINE_DIR = f"{STATE_DIR}/baseline"
MANIFEST_DIR = f"{STATE_DIR}/manifests"  # per synced directory: each file's size, sha256 and mtime
WHEELHOUSE = f"{STATE_DIR}/wheelhouse"
AUDIT_LOG = "/var/log/ernie-deploy/audit.log"

# The names export/program.py fills into the exported host program.
EXPORTED = ("STATE_DIR", "LOCK_DIR", "RELEASES_DIR", "PENDING_FILE", "AUDIT_LOG", "UNIT_DIR", "ENV_DIR")


def loopback(bind: str) -> str:
    """The address a host reaches its own instance on, from the address the instance binds (vLLM's --host).
    A wildcard is reached on the loopback of its family: `::` on ::1, since an IPv6-only socket (bindv6only)
    never answers on 127.0.0.1; an address or a name is used as given."""
    return "127.0.0.1" if bind in ("0.0.0.0", "") else "::1" if bind == "::" else bind


def local_url(bind: str, port: int) -> str:
    """The instance's base URL as its own host sees it (an IPv6 address in brackets)."""
    host = loopback(bind)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
