"""What a rollout did, when: one row per instance, its phases as spans on a shared clock, and marks.

Recorded by the rollout as it runs (thread-safe: hosts of a batch work in parallel) and drawn by
output/timeline.py; times are seconds since the rollout began.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

PHASES = ("hook", "drain", "stop", "gpu-release", "load", "ready", "rollback")


@dataclass(frozen=True)
class Span:
    row: str  # "host unit"
    phase: str  # one of PHASES
    start: float
    end: float
    status: str = "ok"  # ok | failed | warn


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

    def span(self, row: str, phase: str, start: float, status: str = "ok", end: float | None = None) -> None:
        """A span from `start` to `end` (default: now). Hosts of a batch record theirs from parallel threads."""
        with self._lock:
            self.spans.append(Span(row, phase, start, self.now() if end is None else end, status))

    def mark(self, kind: str, label: str) -> None:
        with self._lock:
            self.marks.append(Mark(self.now(), kind, label))

    @property
    def rows(self) -> list[str]:
        """Rows in the order they first appear."""
        return list(dict.fromkeys(s.row for s in self.spans))
