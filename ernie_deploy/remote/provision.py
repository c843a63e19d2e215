"""Provisioning's host side: one probe script (the lock and every fact provisioning decides on, in one round
trip) and the commands that change the host. Secrets travel on stdin only (docs/provisioning.md)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import ClassVar

from ernie_deploy.planning.hostpaths import RELEASES_DIR, UNIT_DIR, WHEELHOUSE
from ernie_deploy.planning.provisioning import ProvisionSpec
from ernie_deploy.planning.settings import VENV_ROOT
from ernie_deploy.remote import filesync
from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.facts import UNIT_GLOB, split_rc, version_script
from ernie_deploy.remote.protocol import MARK_FUNCTION, sections

# Written into a venv provisioning made: `installing` first, `done` (with the version) once pip succeeded.
# Only venvs with the done marker are ever removed; one still `installing` was cut short and is redone.
INSTALLING_MARK = ".ernie-deploy-installing"
DONE_MARK = ".ernie-deploy-venv"
SERVICE_HOME = "/var/lib/vllm"


def _disk_script(path: str, free: bool) -> str:
    """The mount point (with `free`: free KiB, a space, then the mount point) of the file system `path` will
    live on: that of its nearest existing directory. df -P prints one line per file system; the mount point is
    what follows the fifth field, spaces and all."""
    fields = "free=$4; for (i = 0; i < 5; i++) sub(/^[^ ]+ +/, \"\"); print " + ('free " " $0' if free else "$0")
    return (f'd={shlex.quote(path)}; while [ ! -d "$d" ]; do d=$(dirname "$d"); done\n'
            f"df -Pk \"$d\" 2>/dev/null | awk 'NR==2 {{{fields}}}'")


def probe_script(spec: ProvisionSpec) -> str:
    q = shlex.quote
    venv = q(spec.venv)
    used = f"{UNIT_DIR}/{UNIT_GLOB} {RELEASES_DIR}/*{UNIT_DIR}/{UNIT_GLOB}"
    return f"""
{MARK_FUNCTION}
m driver; out=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1); rc=$?
printf '%s\\n' "$out" | head -n 1; echo "rc=$rc"
m user; getent passwd {q(spec.user)} | cut -d: -f1,6,7
m os; ( . /etc/os-release 2>/dev/null; echo "${{ID:-}} ${{ID_LIKE:-}}" )
m python; if ! command -v python3 >/dev/null 2>&1; then echo no-python3
  elif python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then echo ok; else echo no-venv; fi
m venv; if [ -f {venv}/{INSTALLING_MARK} ]; then echo installing; elif [ -f {venv}/{DONE_MARK} ]; then echo ours
  elif [ -e {venv} ]; then echo foreign; else echo absent; fi
m version; {version_script(spec.bin)}
m venvs; for d in {VENV_ROOT}/*/; do [ -f "$d{DONE_MARK}" ] && echo "${{d%/}}"; done
m used; sed -n 's/^ExecStart=\\([^ ]*\\).*/\\1/p' {used} 2>/dev/null | sort -u
{filesync.probe_script("model", spec.model_path)}
{filesync.probe_script("wheels", WHEELHOUSE)}
m venv-disk; {_disk_script(spec.venv, free=True)}
m wheels-mount; {_disk_script(WHEELHOUSE, free=False)}
m end
"""


@dataclass(frozen=True)
class ProvisionProbe(Intent):
    """Read every fact provisioning decides on (driver, user, OS, Python, venvs, model and wheel files)."""

    op: ClassVar[Op] = Op.PROVISION_PROBE
    spec: ProvisionSpec

    def render(self) -> str:
        return probe_script(self.spec)


def probe_command(spec: ProvisionSpec) -> Command:
    return Command(ProvisionProbe(spec))


@dataclass(frozen=True)
class Disk:
    """The file system a path lives on: its mount point and free bytes (None: df said nothing readable)."""

    mount: str
    free_bytes: int | None


def parse_disk(text: str) -> Disk:
    free, _, mount = text.strip().partition(" ")
    return Disk(mount.strip() or "?", int(free) * 1024 if free.isdigit() else None)


@dataclass(frozen=True)
class ProvisionFacts:
    driver: str | None
    driver_error: str | None
    user: tuple[str, str, str] | None  # name, home, shell
    os_ids: tuple[str, ...]
    python: str  # ok, no-python3, no-venv
    venv: str  # absent, installing, ours, foreign
    version: str | None
    venvs: tuple[str, ...]  # venvs provisioning installed
    used: frozenset[str]  # venvs an installed unit or a kept release runs
    model: filesync.DirState
    wheels: filesync.DirState
    venv_disk: Disk = Disk("?", None)  # where the venv will be installed
    wheels_mount: str = "?"


def parse_probe(text: str) -> ProvisionFacts:
    s = sections(text)
    out, rc = split_rc(s.get("driver", "rc=127"))
    driver = out.strip() if rc == 0 and out.strip() else None
    user_line = s.get("user", "").strip().split(":")
    version_text, version_rc = split_rc(s.get("version", "rc=127"))
    version = version_text.strip().splitlines()[-1] if version_rc == 0 and version_text.strip() else None
    used = frozenset(b.rsplit("/bin/", 1)[0] for b in s.get("used", "").split() if "/bin/" in b)
    return ProvisionFacts(
        driver=driver, driver_error=None if driver else (out.strip() or "nvidia-smi not found"),
        user=(user_line[0], user_line[1], user_line[2]) if len(user_line) == 3 else None,
        os_ids=tuple(s.get("os", "").split()), python=s.get("python", "").strip() or "no-python3",
        venv=s.get("venv", "").strip() or "absent", version=version,
        venvs=tuple(s.get("venvs", "").split()), used=used,
        model=filesync.parse_dir_state(s, "model"), wheels=filesync.parse_dir_state(s, "wheels"),
        venv_disk=parse_disk(s.get("venv-disk", "")), wheels_mount=s.get("wheels-mount", "").strip() or "?",
    )


@dataclass(frozen=True)
class CreateUser(Intent):
    """A system user with no login shell and a home for vLLM's caches; its group of the same name."""

    op: ClassVar[Op] = Op.CREATE_USER
    user: str
    audit: dict[str, object]

    def render(self) -> str:
        return (f"set -eu\nuseradd --system --user-group --home-dir {SERVICE_HOME} "
                f"--create-home --shell /usr/sbin/nologin {shlex.quote(self.user)}\n{audit_line(self.audit)}\n")


def create_user_command(user: str, audit: dict[str, object]) -> Command:
    return Command(CreateUser(user, audit))


@dataclass(frozen=True)
class OsPackages(Intent):
    op: ClassVar[Op] = Op.OS_PACKAGES
    manager: str  # apt-get, dnf, yum
    packages: tuple[str, ...]
    audit: dict[str, object]

    def render(self) -> str:
        q = shlex.quote
        names = " ".join(q(p) for p in self.packages)
        if self.manager == "apt-get":
            install = f"DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive " \
                      f"apt-get install -y -q --no-install-recommends {names}"
        else:
            install = f"{q(self.manager)} install -y {names}"
        return f"set -eu\n{install}\n{audit_line(self.audit)}\n"


def os_packages_command(manager: str, packages: tuple[str, ...], audit: dict[str, object]) -> Command:
    return Command(OsPackages(manager, packages, audit), timeout=1200)


@dataclass(frozen=True)
class InstallVllm(Intent):
    """A fresh venv at `venv` and `pip install vllm==VERSION` into it, from `find_links` (a wheelhouse on the
    host; only there unless `indexed`) and the index URL read from stdin, if any."""

    op: ClassVar[Op] = Op.INSTALL_VLLM
    venv: str
    version: str
    find_links: str | None
    indexed: bool
    audit: dict[str, object]

    def render(self) -> str:
        q = shlex.quote
        venv = q(self.venv)
        pip = [f"{self.venv}/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
               "--progress-bar", "off"]
        if self.find_links:
            pip += ["--find-links", self.find_links]
            if not self.indexed:
                pip.append("--no-index")
        pip.append(f"vllm=={self.version}")
        return f"""set -eu
IFS= read -r index || true
if [ -n "$index" ]; then PIP_INDEX_URL=$index; export PIP_INDEX_URL; fi
unset index
rm -rf {venv}
mkdir -p {venv}
touch {venv}/{INSTALLING_MARK}
python3 -m venv {venv}
{" ".join(q(w) for w in pip)}
printf '%s\\n' {q(self.version)} > {venv}/{DONE_MARK}
rm -f {venv}/{INSTALLING_MARK}
{audit_line(self.audit)}
"""


def install_command(spec: ProvisionSpec, find_links: str | None, audit: dict[str, object]) -> Command:
    """The index URL (which may carry credentials) comes on stdin into PIP_INDEX_URL, never on a command
    line."""
    stdin = (spec.index_url.reveal() if spec.index_url else "") + "\n"
    intent = InstallVllm(spec.venv, spec.version, find_links, spec.index_url is not None, audit)
    return Command(intent, stdin=stdin.encode(), timeout=3600, check=False)


@dataclass(frozen=True)
class PruneVenvs(Intent):
    """Remove the venvs provisioning installed (their done marker says so) that nothing runs any more."""

    op: ClassVar[Op] = Op.PRUNE_VENVS
    venvs: tuple[str, ...]
    audit: dict[str, object]

    def render(self) -> str:
        q = shlex.quote
        removes = "\n".join(f"[ -f {q(v)}/{DONE_MARK} ] && rm -rf {q(v)}" for v in self.venvs)
        return f"set -u\n{removes}\n{audit_line(self.audit)}\n"


def prune_command(venvs: list[str], audit: dict[str, object]) -> Command:
    return Command(PruneVenvs(tuple(venvs), audit))
