"""Commands of one instance's restart cycle besides start (converge.activate): read its /metrics while it
drains, stop it, and read whether its GPUs are free again. Parsers are pure and live beside them.

The GPU baseline (used memory per GPU right before the instance started) is written by activate when it
starts a unit that was not running, so the release gate compares against what the GPUs held without it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ernie_deploy.checks.gpus import ComputeApp, GpuRow, csv_number, csv_rows, parse_compute_apps, parse_gpu_rows
from ernie_deploy.planning.hostpaths import BASELINE_DIR
from ernie_deploy.remote import http, systemd
from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.probe import APPS_QUERY, GPU_QUERY
from ernie_deploy.remote.protocol import MARK, split


def baseline_script(unit: str, gpus: tuple[int, ...]) -> str:
    """Record the GPUs' used memory before `unit` starts, unless it runs already (then it holds them)."""
    q = shlex.quote
    path = f"{BASELINE_DIR}/{unit}"
    ids = ",".join(str(g) for g in gpus)
    return (f"if ! systemctl is-active -q {q(unit)}; then mkdir -p {BASELINE_DIR}; "
            f"nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -i {ids} > {q(path)}.new "
            f"2>/dev/null && mv -f {q(path)}.new {q(path)} || rm -f {q(path)}.new; fi")


@dataclass(frozen=True)
class Stop(Intent):
    """systemctl stop (SIGTERM to the API server, which drains; SIGKILL to what is left after TimeoutStopSec),
    then whether systemd had to kill the old run."""

    op: ClassVar[Op] = Op.STOP
    unit: str
    audit: dict[str, Any]
    gpu_units: tuple[str, ...] = ()  # then read the GPUs of these units (GpuRelease), in the same round trip

    def render(self) -> str:
        q = shlex.quote
        unit = self.unit
        return "\n".join([
            "set -u",
            f"OLD=$(systemctl show -p InvocationID --value {q(unit)})",
            f"systemctl stop {q(unit)}",
            f"printf '{MARK}stopped %s\\n' \"$(systemctl show -p ActiveState --value {q(unit)})\"",
            # systemd logs this when the process outlived TimeoutStopSec and got SIGKILL (requests were cut).
            f"if [ -n \"$OLD\" ] && journalctl INVOCATION_ID=\"$OLD\" -o cat --no-pager 2>/dev/null | "
            f"grep -q 'timed out. Killing'; then printf '{MARK}killed\\n'; fi",
            audit_line(self.audit),
        ]) + "\n" + (GpuRelease(self.gpu_units).render() if self.gpu_units else "")


def stop_command(unit: str, audit: dict[str, Any], gpu_units: Sequence[str] = ()) -> Command:
    """Stop `unit`; with `gpu_units`, read their GPUs right after it stopped (parse_gpus reads the output): the
    GPU gate's first reading without a round trip of its own."""
    return Command(Stop(unit, audit, tuple(gpu_units)), timeout=3600)


@dataclass(frozen=True)
class Metrics(Intent):
    """One read of an instance's /metrics (`request`, made on the host), while it drains."""

    op: ClassVar[Op] = Op.METRICS
    unit: str
    request: http.Request

    def render(self) -> str:
        return http.script()


def metrics_command(unit: str, request: http.Request) -> Command:
    return Command(Metrics(unit, request), stdin=http.stdin([request], None), check=False)


@dataclass(frozen=True)
class Stopped:
    state: str
    killed: bool


def parse_stop(text: str) -> Stopped:
    state, killed = "", False
    for line in text.splitlines():
        if line.startswith(f"{MARK}stopped "):
            state = line.split(" ", 1)[1].strip()
        elif line == f"{MARK}killed":
            killed = True
    return Stopped(state, killed)


@dataclass(frozen=True)
class GpuRelease(Intent):
    """The units' states and baselines, every GPU's memory, and the compute processes with their names and
    units."""

    op: ClassVar[Op] = Op.GPU_RELEASE
    units: tuple[str, ...]

    def render(self) -> str:
        q = shlex.quote
        per_unit = "".join(f"printf '{MARK}unit %s\\n' {q(u)}; {systemd.show_one(u)}\n"
                           f"printf '{MARK}baseline %s\\n' {q(u)}; cat {q(BASELINE_DIR + '/' + u)} 2>/dev/null; true\n"
                           for u in self.units)
        return (per_unit +
                f"printf '{MARK}gpus\\n'; {GPU_QUERY} 2>&1\n"
                f"a=$({APPS_QUERY} 2>&1); printf '{MARK}apps\\n'; [ -z \"$a\" ] || printf '%s\\n' \"$a\"\n"
                f"printf '{MARK}ps\\n'; ps -e -o pid=,comm=\n"
                # The unit each GPU process belongs to (its cgroup), so another running instance sharing the GPU
                # is not taken for an orphan; the PIDs are the apps query's first column (no nvidia-smi of its own:
                # each call is tens of milliseconds on a real host, as the driver is asked again).
                f"printf '{MARK}cgroups\\n'; printf '%s\\n' \"$a\" | while IFS=', ' read -r p _; do "
                "case $p in ''|*[!0-9]*) continue;; esac; "
                f"printf '%s %s\\n' \"$p\" \"$(tail -n 1 /proc/$p/cgroup 2>/dev/null | sed 's|.*/||')\"; done\n")


def gpu_command(units: Sequence[str]) -> Command:
    return Command(GpuRelease(tuple(units)))


@dataclass
class GpuReading:
    states: dict[str, systemd.UnitState] = field(default_factory=dict)
    rows: list[GpuRow] = field(default_factory=list)
    apps: list[ComputeApp] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    units: dict[int, str] = field(default_factory=dict)  # GPU process → the systemd unit it belongs to
    baselines: dict[str, dict[int, float]] = field(default_factory=dict)  # unit → GPU → MiB (absent: none kept)


def parse_gpus(text: str) -> GpuReading:
    sections: dict[str, list[str]] = {}
    for section in split(text):
        sections.setdefault(section.header, []).extend(section.lines)
    reading = GpuReading()
    reading.rows = parse_gpu_rows("\n".join(sections.get("gpus", [])))
    reading.apps = parse_compute_apps("\n".join(sections.get("apps", [])))
    for line in sections.get("ps", []):
        pid, _, name = line.strip().partition(" ")
        if pid.isdigit():
            reading.names[int(pid)] = name.strip()
    for line in sections.get("cgroups", []):
        pid, _, unit = line.strip().partition(" ")
        if pid.isdigit() and unit.strip():
            reading.units[int(pid)] = unit.strip()
    for key, lines in sections.items():
        kind, _, unit = key.partition(" ")
        if kind == "unit":
            reading.states[unit] = systemd.parse_state("\n".join(lines))
        elif kind == "baseline" and any(line.strip() for line in lines):
            what = f"baseline of {unit}"
            baseline = {}
            for lineno, (index, used) in csv_rows("\n".join(lines), 2, what):
                value = csv_number(used, what, lineno, "memory.used")
                if index.isdigit() and value is not None:
                    baseline[int(index)] = value
            reading.baselines[unit] = baseline
    return reading
