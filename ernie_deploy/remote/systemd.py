"""`systemctl show` for our units: the property list asked for, and the one parser of its output."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

PROPS = ("Id", "LoadState", "ActiveState", "SubState", "Result", "MainPID", "InvocationID", "NRestarts",
         "ExecMainStartTimestampMonotonic", "UnitFileState")


@dataclass(frozen=True)
class UnitState:
    name: str = ""
    load_state: str = ""
    active_state: str = ""
    sub_state: str = ""
    result: str = ""
    main_pid: int = 0
    invocation_id: str = ""
    n_restarts: int = 0
    started_monotonic: int = 0  # ExecMainStartTimestampMonotonic, µs; changes on every (re)start
    unit_file_state: str = ""


def show_command(unit_expr: str) -> str:
    """`systemctl show` of the properties above; unit_expr is shell text (already quoted or a "$var")."""
    return f"systemctl show --no-pager -p {','.join(PROPS)} {unit_expr}"


def show_one(unit: str) -> str:
    return show_command(shlex.quote(unit))


def _num(props: dict[str, str], key: str) -> int:
    value = props.get(key, "")
    return int(value) if value.isdigit() else 0


def parse_state(text: str) -> UnitState:
    """One unit's `systemctl show` block."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return UnitState(
        name=props.get("Id", ""), load_state=props.get("LoadState", ""), active_state=props.get("ActiveState", ""),
        sub_state=props.get("SubState", ""), result=props.get("Result", ""), main_pid=_num(props, "MainPID"),
        invocation_id=props.get("InvocationID", ""), n_restarts=_num(props, "NRestarts"),
        started_monotonic=_num(props, "ExecMainStartTimestampMonotonic"),
        unit_file_state=props.get("UnitFileState", ""))


def parse_units(body: str) -> dict[str, UnitState]:
    """Several blocks separated by blank lines, keyed by unit name."""
    units = {}
    for block in re.split(r"\n\s*\n", body.strip()):
        state = parse_state(block)
        if state.name:
            units[state.name] = state
    return units
