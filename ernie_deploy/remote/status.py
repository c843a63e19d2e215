"""What `status` reads on a host besides the facts, in the same round trip: the kept releases, the audit log's
tail, and the command line and cgroup of every process that looks like `vllm serve` (main processes and any
started by hand). Command lines travel base64-encoded with their arguments split on \\x1f, so an argument
holding spaces stays one argument."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from ernie_deploy.planning.hostpaths import AUDIT_LOG, UNIT_DIR
from ernie_deploy.remote.facts import UNIT_GLOB
from ernie_deploy.remote.protocol import MARK_FUNCTION, sections
from ernie_deploy.remote.releases import Release, list_command, parse_list

AUDIT_LINES = 20


def status_script() -> str:
    return f"""
{MARK_FUNCTION}
{list_command().script}
m status-audit; tail -n {AUDIT_LINES} {AUDIT_LOG} 2>/dev/null
m status-main
for f in {UNIT_DIR}/{UNIT_GLOB}; do [ -f "$f" ] || continue
  printf '%s %s\\n' "${{f##*/}}" "$(systemctl show -p MainPID --value "${{f##*/}}")"; done
m status-procs
for f in $(grep -las serve /proc/[0-9]*/cmdline); do p=${{f%/cmdline}}; p=${{p#/proc/}}
  [ "$p" = "$$" ] && continue
  printf '%s %s %s\\n' "$p" "$(tr '\\000' '\\037' < "$f" 2>/dev/null | base64 -w0)" \\
    "$(sed -n 's/^0:://p; s/^[0-9]*:name=systemd://p' /proc/"$p"/cgroup 2>/dev/null | head -n 1)"; done
m status-end
"""


@dataclass(frozen=True)
class Proc:
    pid: int
    argv: tuple[str, ...]
    cgroup: str

    @property
    def serve_args(self) -> tuple[str, ...] | None:
        """The arguments after `serve` when this is `vllm serve` (argv[0] or argv[1] is a `vllm` program)."""
        head = [a.rsplit("/", 1)[-1] for a in self.argv[:2]]
        if "vllm" not in head or "serve" not in self.argv:
            return None
        return self.argv[self.argv.index("serve") + 1:]

    @property
    def unit(self) -> str | None:
        """The systemd service whose cgroup holds the process, or None (a login session, a container)."""
        name = self.cgroup.rsplit("/", 1)[-1]
        return name if name.endswith(".service") else None


@dataclass(frozen=True)
class HostStatus:
    releases: list[Release]
    audit: list[dict[str, Any]]
    main_pids: dict[str, int]
    procs: dict[int, Proc]


def parse(text: str) -> HostStatus:
    s = sections(text)
    audit = []
    for line in s.get("status-audit", "").splitlines():
        try:
            audit.append(json.loads(line))
        except ValueError:
            continue
    mains = {}
    for line in s.get("status-main", "").splitlines():
        unit, _, pid = line.partition(" ")
        if pid.strip().isdigit():
            mains[unit] = int(pid)
    procs = {}
    for line in s.get("status-procs", "").splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        try:
            argv = tuple(base64.b64decode(parts[1]).decode(errors="replace").rstrip("\x1f").split("\x1f"))
        except ValueError:
            continue
        procs[int(parts[0])] = Proc(int(parts[0]), argv, parts[2] if len(parts) > 2 else "")
    # Release lines carry their own marker, so they are read from the whole text.
    return HostStatus(parse_list(text), audit, mains, procs)
