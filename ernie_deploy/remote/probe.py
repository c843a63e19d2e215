"""Remote scripts that read a running instance (systemd state, this start's journal, GPUs, processes) in
one command, and pure parsers of their output."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

MARK = "@@ernie-deploy:"
PROPS = "ActiveState,SubState,Result,NRestarts,InvocationID,MainPID,ExecMainStartTimestampMonotonic"
GPU_QUERY = "nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits"
APPS_QUERY = "nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits"


@dataclass
class UnitState:
    active: str = ""
    sub: str = ""
    result: str = ""
    restarts: int = 0
    invocation: str = ""
    main_pid: int = 0
    started: int = 0
    journal: list[str] = field(default_factory=list)
    cursor: str | None = None


def _journal(unit: str, since: str | None, cursor: str | None) -> str:
    q = shlex.quote
    if cursor:
        where = f"-u {q(unit)} --after-cursor={q(cursor)}"
    elif since:
        where = f"-u {q(unit)} --since={q(since)}"
    else:
        # This invocation only: the service's own lines plus systemd's lines about it.
        where = '_SYSTEMD_INVOCATION_ID="$ID" + INVOCATION_ID="$ID"'
    return f'ID=$(systemctl show -p InvocationID --value {q(unit)}); ' \
           f'[ -n "$ID" ] || [ -n {q(since or cursor or "")} ] && journalctl {where} -o cat --no-pager --show-cursor'


def unit_script(unit: str, *, since: str | None = None, cursor: str | None = None) -> str:
    """State and new journal lines of one unit: since a time (@epoch), after a cursor, or this invocation."""
    q = shlex.quote
    return (f"printf '{MARK}unit %s\\n' {q(unit)}; systemctl show -p {PROPS} {q(unit)}; "
            f"printf '{MARK}journal %s\\n' {q(unit)}; {_journal(unit, since, cursor)} 2>/dev/null; true\n")


def host_script(units: list[str]) -> str:
    """Everything verify needs from a host in one command."""
    return "".join(unit_script(u) for u in units) + (
        f"printf '{MARK}gpus\\n'; {GPU_QUERY} 2>&1\n"
        f"printf '{MARK}apps\\n'; {APPS_QUERY} 2>&1\n"
        f"printf '{MARK}ps\\n'; ps -e -o pid=,ppid=\n")


def parse(text: str) -> tuple[dict[str, UnitState], dict[str, str]]:
    """(unit states by name, other sections by name)."""
    units: dict[str, UnitState] = {}
    other: dict[str, list[str]] = {}
    target: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(MARK):
            kind, _, name = line[len(MARK):].partition(" ")
            if kind == "unit":
                units.setdefault(name, UnitState())
                target = other.setdefault(f"unit {name}", [])
            elif kind == "journal":
                target = units.setdefault(name, UnitState()).journal
            else:
                target = other.setdefault(kind, [])
            continue
        if target is not None:
            target.append(line)
    for name, state in units.items():
        props = dict(line.split("=", 1) for line in other.pop(f"unit {name}", []) if "=" in line)
        state.active, state.sub, state.result = props.get("ActiveState", ""), props.get("SubState", ""), \
            props.get("Result", "")
        state.restarts = int(props.get("NRestarts") or 0)
        state.invocation = props.get("InvocationID", "")
        state.main_pid = int(props.get("MainPID") or 0)
        state.started = int(props.get("ExecMainStartTimestampMonotonic") or 0)
        if state.journal and state.journal[-1].startswith("-- cursor: "):
            state.cursor = state.journal.pop()[len("-- cursor: "):]
    return units, {k: "\n".join(v) for k, v in other.items()}


def descendants(ps_text: str, root: int) -> set[int]:
    """The process tree under `root` (vLLM's API server, EngineCore and workers), from `ps -o pid=,ppid=`."""
    children: dict[int, list[int]] = {}
    for line in ps_text.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    found, todo = set(), [root] if root else []
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


