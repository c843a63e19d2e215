"""Per-host results of multi-host operations: the steps each host went through, its status, the exit code.

A host result holds its steps (name, status, seconds, evidence, changed), so batches, drains and restarts
can report themselves; output/ renders results to rich or to versioned JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import ExitCode
from ernie_deploy.planning.findings import Finding


class Status(Enum):
    OK = "ok"
    CHANGED = "changed"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    SKIPPED = "skipped"
    LOCKED = "locked"


@dataclass
class Step:
    name: str
    status: str  # ok | changed | failed | skipped
    seconds: float = 0.0
    evidence: list[str] = field(default_factory=list)
    changed: bool = False
    ended_at: float = 0.0  # wall clock (epoch seconds) when it ended, to line up with the host's journal


@dataclass
class HostResult:
    host: str
    status: Status = Status.OK
    message: str = ""
    hint: str | None = None
    changed_files: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)  # installed units the plan no longer has
    dropins: list[str] = field(default_factory=list)  # drop-in files overriding managed units
    reasons: dict[str, str] = field(default_factory=dict)
    diffs: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    release: str | None = None
    batch: int | None = None  # the rollout batch the host was in (1-based)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # unit → phase → seconds
    rollbacks: list[str] = field(default_factory=list)  # what was restored after a failure, and how it went
    commands: int = 0
    command_log: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        """Failed, unreachable, locked or skipped: later phases leave this host alone."""
        return self.status in (Status.FAILED, Status.UNREACHABLE, Status.LOCKED, Status.SKIPPED)

    def fail(self, status: Status, message: str, hint: str | None = None) -> None:
        self.status, self.message, self.hint = status, message, hint


def recap_counts(r: HostResult) -> dict[str, int]:
    """Ansible's recap columns: ok counts the host's successful steps, changed those that changed it."""
    changed = len(r.changed_files) + len(r.restarted) + len(r.started) + len(r.pruned) + len(r.enabled)
    return {
        "ok": 1 if r.status in (Status.OK, Status.CHANGED) else 0,
        "changed": changed if r.status is not Status.UNREACHABLE else 0,
        "unreachable": 1 if r.status is Status.UNREACHABLE else 0,
        "failed": 1 if r.status in (Status.FAILED, Status.LOCKED) else 0,
        "skipped": 1 if r.status is Status.SKIPPED else 0,
    }


def exit_code(results: Sequence[HostResult], stopped_by: int | None = None) -> int:
    """ansible-playbook's precedence; a run stopped by a signal exits 128 + its number (130 Ctrl-C, 143 SIGTERM)."""
    if stopped_by is not None:
        return 128 + stopped_by
    statuses = {r.status for r in results}
    if Status.UNREACHABLE in statuses:
        return ExitCode.UNREACHABLE
    if Status.FAILED in statuses:
        return ExitCode.FAILED
    if Status.LOCKED in statuses:
        return ExitCode.LOCKED
    return ExitCode.OK
