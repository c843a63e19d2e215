"""Remote scripts that read running instances in one command (HTTP answers made on the host, systemd state,
this start's journal, GPUs, processes), and pure parsers of their output."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import ClassVar

from ernie_deploy.remote import http, systemd
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.protocol import MARK, split

GPU_QUERY = "nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits"
APPS_QUERY = "nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits"


@dataclass
class UnitProbe:
    """One unit: its systemd state and the journal lines asked for (this invocation, since, or after a cursor)."""

    state: systemd.UnitState = field(default_factory=systemd.UnitState)
    journal: list[str] = field(default_factory=list)
    cursor: str | None = None
    invocation: str = ""  # the run the journal lines belong to


@dataclass
class HostProbe:
    units: dict[str, UnitProbe] = field(default_factory=dict)
    http: dict[str, http.Answer] = field(default_factory=dict)
    gpus: str = ""
    apps: str = ""
    ps: str = ""
    now_us: int | None = None

    def unit(self, name: str) -> UnitProbe:
        return self.units.get(name, UnitProbe())


def unit_script(unit: str, *, invocation: str | None = None, cursor: str | None = None) -> str:
    """State and journal lines of the unit's current run (its InvocationID): all of them, or only those after
    `cursor` while the run is still `invocation`. Lines of earlier runs (an old process's shutdown) never
    appear, so a watch after a restart judges only the new process."""
    q = shlex.quote
    after = f"--after-cursor={cursor}" if cursor else ""  # quoted once, as the value of A below
    return (f"printf '{MARK}unit %s\\n' {q(unit)}; {systemd.show_one(unit)}; "
            f"ID=$(systemctl show -p InvocationID --value {q(unit)}); "
            f"printf '{MARK}journal %s %s\\n' {q(unit)} \"$ID\"; "
            f"if [ -n \"$ID\" ]; then if [ \"$ID\" = {q(invocation or '-')} ]; then A={q(after)}; else A=; fi; "
            f"journalctl _SYSTEMD_INVOCATION_ID=\"$ID\" + INVOCATION_ID=\"$ID\" $A -o cat --no-pager --show-cursor "
            f"2>/dev/null; fi; true\n")


def _http_part(requests: tuple[http.Request, ...]) -> str:
    # First in the script: the probe program reads its requests from stdin, which nothing else may take.
    return f"printf '{MARK}http\\n'; {http.script()}" if requests else ""


@dataclass(frozen=True)
class Probe(Intent):
    """Everything verify needs from a host in one command: the `requests`' answers, each unit's state and
    journal, GPUs, processes and the host's clock."""

    op: ClassVar[Op] = Op.PROBE
    units: tuple[str, ...]
    requests: tuple[http.Request, ...]

    def render(self) -> str:
        return _http_part(self.requests) + "".join(unit_script(u) for u in self.units) + (
            f"printf '{MARK}gpus\\n'; {GPU_QUERY} 2>&1\n"
            f"printf '{MARK}apps\\n'; {APPS_QUERY} 2>&1\n"
            f"printf '{MARK}ps\\n'; ps -e -o pid=,ppid=\n"
            f"printf '{MARK}now\\n'; {systemd.NOW}\n")


def host_command(units: list[str], requests: list[http.Request], api_key: str | None) -> Command:
    return Command(Probe(tuple(units), tuple(requests)), stdin=http.stdin(requests, api_key))


@dataclass(frozen=True)
class Watch(Intent):
    """One poll of the readiness watch: the unit's state, its journal lines of run `invocation` after `cursor`,
    and the `requests`' answers."""

    op: ClassVar[Op] = Op.WATCH
    unit: str
    invocation: str | None
    cursor: str | None
    requests: tuple[http.Request, ...]

    @property
    def label(self) -> str:
        return f"{self.op.value} {self.unit}"

    def render(self) -> str:
        return _http_part(self.requests) + unit_script(self.unit, invocation=self.invocation, cursor=self.cursor)


def watch_command(unit: str, *, invocation: str | None, cursor: str | None, requests: list[http.Request],
                  api_key: str | None) -> Command:
    return Command(Watch(unit, invocation, cursor, tuple(requests)), stdin=http.stdin(requests, api_key),
                   check=False)


def parse(text: str) -> HostProbe:
    probe = HostProbe()
    sections: dict[str, list[str]] = {}
    for section in split(text, records=("http",)):  # the answers are lines of the http section
        if section.kind == "unit":
            sections.setdefault(section.header, []).extend(section.lines)
            probe.units.setdefault(section.arg, UnitProbe())
        elif section.kind == "journal":
            name, _, invocation = section.arg.partition(" ")
            unit = probe.units.setdefault(name, UnitProbe())
            unit.invocation = invocation.strip()
            unit.journal.extend(section.lines)
        else:
            sections.setdefault(section.kind, []).extend(section.lines)
    for name, unit in probe.units.items():
        unit.state = systemd.parse_state("\n".join(sections.pop(f"unit {name}", [])))
        if unit.journal and unit.journal[-1].startswith("-- cursor: "):
            unit.cursor = unit.journal.pop()[len("-- cursor: "):]
    probe.http = http.parse("\n".join(sections.get("http", [])))
    probe.gpus, probe.apps, probe.ps = ("\n".join(sections.get(k, [])) for k in ("gpus", "apps", "ps"))
    now = "".join(sections.get("now", [])).strip()
    probe.now_us = int(now) if now.isdigit() else None
    return probe


def descendants(ps_text: str, root: int) -> set[int]:
    """The process tree under `root` (vLLM's API server, EngineCore and workers), from `ps -o pid=,ppid=`."""
    children: dict[int, list[int]] = {}
    for line in ps_text.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    found: set[int] = set()
    todo = [root] if root else []
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found
