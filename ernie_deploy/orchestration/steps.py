"""The steps a host goes through in an operation, and how each went.

A step that is a phase of a restart cycle (cycle.py) also carries the phase, its units and its times on the
rollout's clock: the timeline's spans (timeline.py), the per-instance timings table and the JSON steps are all
derived from it, so a phase is recorded once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

# Phases timed by their step's own duration, under the timings table's names.
TIMED = {"drain": "drain", "stop": "stop", "gpu-release": "gpu_release"}


class StepStatus(StrEnum):
    """How a step, a timeline span or a provisioning action went; the values are what the JSON shows."""

    OK = "ok"
    CHANGED = "changed"
    FAILED = "failed"
    SKIPPED = "skipped"
    WARN = "warn"
    WOULD_CHANGE = "would change"  # check mode
    WOULD_CHECK = "would check"  # check mode, where only the host can tell (a Hub revision)


@dataclass
class Step:
    name: str
    status: StepStatus = StepStatus.OK
    seconds: float = 0.0
    evidence: list[str] = field(default_factory=list)
    changed: bool = False
    ended_at: float = 0.0  # wall clock (epoch seconds) when it ended, to line up with the host's journal
    # A phase of a restart cycle (timeline.PHASES; None for any other step), on the rollout's clock:
    phase: str | None = None
    units: tuple[str, ...] = ()
    started: float = 0.0  # where the phase began: for a readiness watch, the start of the unit it watches
    ended: float = 0.0
    healthy: float | None = None  # a readiness watch: when the instance first served (loading ends there)
    restored: bool = False  # a readiness watch of what ran before, after a failed start (a rollback)


def phase_timings(steps: Iterable[Step]) -> dict[str, dict[str, float]]:
    """unit → phase → seconds, from the phase steps: how long each instance drained, stopped, waited for its
    GPUs, took to become ready (`rollback_ready` for a restored one) and to load (until it first served)."""
    out: dict[str, dict[str, float]] = {}
    for step in steps:
        for unit in step.units:
            if step.phase in TIMED:
                out.setdefault(unit, {})[TIMED[step.phase]] = round(step.seconds, 3)
            elif step.phase == "ready":
                mine = out.setdefault(unit, {})
                mine["rollback_ready" if step.restored else "ready"] = round(step.seconds, 3)
                if step.healthy is not None and not step.restored:
                    watched = step.ended - step.seconds  # the watch began after the start, which began the load
                    mine["load"] = round(step.healthy - watched, 3)
    return out
