"""`systemctl show` for our units: the property list asked for, and the one parser of its output."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

PROPS = ("Id", "LoadState", "ActiveState", "SubState", "Result", "MainPID", "InvocationID", "NRestarts",
         "ExecMainStartTimestampMonotonic", "UnitFileState", "NeedDaemonReload", "Restart")


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
    need_daemon_reload: bool = False  # the unit file changed on disk since systemd loaded it
    restart: str = ""  # its Restart= policy as systemd runs it ("always", "on-failure", ...)


# The host's monotonic clock in µs, to age ExecMainStartTimestampMonotonic. /proc/uptime counts from boot, which
# equals CLOCK_MONOTONIC on hosts that never suspend (servers).
# The monotonic clock in µs, as systemd's *TimestampMonotonic: /proc/uptime's seconds always have two decimals
# (proc(5)), so the shell writes µs without a process of its own; awk where the line looks otherwise.
NOW = ("read -r up _ < /proc/uptime; case $up in *.[0-9][0-9]) echo \"${up%.*}${up#*.}0000\";; "
       "*) awk '{printf \"%.0f\\n\", $1 * 1000000}' /proc/uptime;; esac")


def up_seconds(state: UnitState, now_us: int | None) -> float | None:
    """How long the unit's current process has been up, or None when it is not running or the clock is unknown."""
    if state.active_state != "active" or state.sub_state != "running" or not now_us or not state.started_monotonic:
        return None
    return (now_us - state.started_monotonic) / 1e6


def started_at(state: UnitState, now_us: int | None, wall_now: float | None) -> float | None:
    """Wall-clock time (epoch seconds) the unit's current process started, or None when unknown."""
    if not state.started_monotonic or not now_us or wall_now is None or state.main_pid == 0:
        return None
    return wall_now - (now_us - state.started_monotonic) / 1e6


def restarted_recently(state: UnitState, now_us: int | None, window_s: float) -> bool:
    """systemd revived the unit and its process has not stayed up for the window since (or is not up at all).
    Every automatic restart starts a new process, so restarts before one that has stayed up are history."""
    up = up_seconds(state, now_us)
    return state.n_restarts > 0 and (up is None or up < window_s)


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
        unit_file_state=props.get("UnitFileState", ""), need_daemon_reload=props.get("NeedDaemonReload") == "yes",
        restart=props.get("Restart", ""))


def parse_units(body: str) -> dict[str, UnitState]:
    """Several blocks separated by blank lines, keyed by unit name."""
    units = {}
    for block in re.split(r"\n\s*\n", body.strip()):
        state = parse_state(block)
        if state.name:
            units[state.name] = state
    return units
