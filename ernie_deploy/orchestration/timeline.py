"""What a rollout did, when: one row per instance, its phases as spans on a shared clock, and marks.

The spans are derived from the phase steps of each host (steps.py) as the rollout records them (thread-safe:
hosts of a batch work in parallel), and drawn by output/timeline.py; times are seconds since the rollout began.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ernie_deploy.orchestration.steps import Step, StepStatus

PHASES = ("balancer", "hook", "drain", "stop", "gpu-release", "load", "ready", "rollback")


@dataclass(frozen=True)
class Span:
    row: str  # "host unit"
    phase: str  # one of PHASES
    start: float
    end: float
    status: StepStatus = StepStatus.OK  # ok | failed | warn


@dataclass(frozen=True)
class Mark:
    at: float
    kind: str  # batch | stop | rollback
    label: str


@dataclass
class Timeline:
    started_at: float = field(default_factory=time.time)  # wall clock (epoch) of t = 0, for the title
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def record(self, host: str, step: Step) -> None:
        """A phase step's spans. Hosts of a batch record theirs from parallel threads."""
        with self._lock:
            self.spans += spans_of(host, step)

    def mark(self, kind: str, label: str) -> None:
        with self._lock:
            self.marks.append(Mark(self.now(), kind, label))

    @property
    def rows(self) -> list[str]:
        """Rows in the order they first appear."""
        return list(dict.fromkeys(s.row for s in self.spans))


def spans_of(host: str, step: Step) -> list[Span]:
    """A phase step drawn: one span per unit; a readiness watch is its unit loading (from its start) until it
    first served, then ready; the undo step draws the units it could only stop and disable (nothing to go back
    to), a warning."""
    if step.phase is None:
        return []
    out = []
    for unit in step.units:
        row = f"{host} {unit}"
        if step.phase == "ready":
            loading = "rollback" if step.restored else "load"
            out.append(Span(row, loading, step.started, step.ended if step.healthy is None else step.healthy,
                            step.status))
            if step.healthy is not None:
                out.append(Span(row, "ready", step.healthy, step.ended, step.status))
        else:
            status = StepStatus.WARN if step.phase == "rollback" else step.status
            out.append(Span(row, step.phase, step.started, step.ended, status))
    return out
