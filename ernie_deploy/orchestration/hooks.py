"""Drain hooks: operator commands run on the controller around each instance's restart (docs/hooks.md).

`--pre-drain` takes the instance out of the load balancer before it is stopped (vLLM's /health stays 200
while it drains, so a balancer would not notice by itself); `--post-ready` puts it back once it passed the
readiness gate. Context travels in ERNIE_* environment variables, never secrets. A non-zero exit or a run
past the timeout is a failure that stops the rollout.

Whatever pre-drain did is undone for every instance that ends serving: post-ready runs for it also when the
rollout stops, is interrupted or rolls the instance back. An instance that does not serve at the end stays
recorded as out of rotation (`Rotation`): the result names it and `--resume` runs post-ready once it serves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ernie_deploy.planning.plantypes import HostPlan, InstancePlan

OUTPUT_LINES = 10


@dataclass(frozen=True)
class HookResult:
    ok: bool
    summary: str
    output: list[str]


def environment(name: str, command: str, plan: HostPlan, inst: InstancePlan, batch: int) -> dict[str, str]:
    return {"ERNIE_HOOK": name, "ERNIE_COMMAND": command, "ERNIE_HOST": plan.name, "ERNIE_ADDRESS": plan.address,
            "ERNIE_PORT": str(inst.port), "ERNIE_UNIT": f"{inst.unit}.service", "ERNIE_INSTANCE": str(inst.index),
            "ERNIE_MODEL": inst.served_model_name, "ERNIE_BATCH": str(batch)}


def run(name: str, shell: str, env: dict[str, str], timeout: float) -> HookResult:
    """Run one hook with /bin/sh -c in its own process group, so a timeout ends the whole pipeline."""
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", shell], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return HookResult(False, f"{name} hook could not start: {exc}", [])
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended in the meantime
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return HookResult(False, f"{name} hook ran past its timeout of {timeout:.0f}s and was killed",
                          _tail(out))
    lines = _tail(out)
    if proc.returncode != 0:
        return HookResult(False, f"{name} hook exited {proc.returncode}", lines)
    return HookResult(True, f"{name} hook ok", lines)


def _tail(out: bytes) -> list[str]:
    return out.decode(errors="replace").splitlines()[-OUTPUT_LINES:]


class Rotation:
    """Instances out of the load balancer: recorded before their pre-drain hook starts (so a controller killed
    with -9 mid-hook or mid-restart still left the record behind) and forgotten once post-ready put them back.
    `saved` runs after every change (the rollout keeps the record in its resume state); hosts' threads share it."""

    def __init__(self, out: dict[str, list[str]] | None = None) -> None:
        self._out: dict[str, list[str]] = {h: list(units) for h, units in (out or {}).items() if units}
        self._lock = threading.Lock()
        self.saved: Callable[[], None] = lambda: None

    def pulled(self, host: str, unit: str) -> None:
        with self._lock:
            units = self._out.setdefault(host, [])
            if unit in units:
                return
            units.append(unit)
        self.saved()

    def back(self, host: str, unit: str) -> None:
        with self._lock:
            units = self._out.get(host, [])
            if unit not in units:
                return
            units.remove(unit)
            if not units:
                del self._out[host]
        self.saved()

    def out_of(self, host: str) -> list[str]:
        with self._lock:
            return list(self._out.get(host, []))

    def snapshot(self) -> dict[str, list[str]]:
        with self._lock:
            return {h: list(units) for h, units in self._out.items()}
