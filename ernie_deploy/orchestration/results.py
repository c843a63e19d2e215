"""Per-host results of multi-host operations: the steps each host went through, its status, the exit code.

A host result is a core every operation fills (status, message, steps, checks, evidence, findings) plus one
typed detail of the operation that made it (details.py): what a deploy, restart or rollback changed, what
provisioning did, what status read (steps.py has the steps). output/ renders results to rich or to
versioned JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import ExitCode
from ernie_deploy.orchestration.details import Change, Detail, ProvisionReport, StatusReport
from ernie_deploy.orchestration.steps import Step, phase_timings
from ernie_deploy.planning.findings import Finding

D = TypeVar("D", Change, ProvisionReport, StatusReport)


class Status(Enum):
    OK = "ok"
    CHANGED = "changed"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    SKIPPED = "skipped"
    LOCKED = "locked"


@dataclass
class HostResult:
    host: str
    status: Status = Status.OK
    message: str = ""
    hint: str | None = None
    findings: list[Finding] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    detail: Detail | None = None  # the operation's own part (None: verify, hooks, commands)
    commands: int = 0
    command_log: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        """Failed, unreachable, locked or skipped: later phases leave this host alone."""
        return self.status in (Status.FAILED, Status.UNREACHABLE, Status.LOCKED, Status.SKIPPED)

    def detail_of(self, kind: type[D]) -> D:
        """The operation's detail to read: an empty one for a host the operation did not reach."""
        return self.detail if isinstance(self.detail, kind) else kind()

    @property
    def change(self) -> Change:
        return self.detail_of(Change)

    def changing(self) -> Change:
        """The change detail a deploy, restart or rollback fills in, set up by the first of them to touch it."""
        if not isinstance(self.detail, Change):
            self.detail = Change()
        return self.detail

    @property
    def timings(self) -> dict[str, dict[str, float]]:
        return phase_timings(self.steps)

    def fail(self, status: Status, message: str, hint: str | None = None) -> None:
        self.status, self.message, self.hint = status, message, hint


def recap_counts(r: HostResult) -> dict[str, int]:
    """Ansible's recap columns: ok counts the host's successful steps, changed those that changed it."""
    c = r.change
    changed = len(c.changed_files) + len(c.restarted) + len(c.started) + len(c.pruned) + len(c.enabled)
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
