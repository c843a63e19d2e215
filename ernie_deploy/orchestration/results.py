"""Per-host results of multi-host operations, the PLAY RECAP and the exit code they add up to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ernie_deploy.checks.result import CheckResult
from ernie_deploy.planning.findings import Finding

JSON_SCHEMA = "ernie-deploy/deploy/v1"


class Status(Enum):
    OK = "ok"
    CHANGED = "changed"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    SKIPPED = "skipped"
    LOCKED = "locked"


# ansible-playbook's codes: 2 a host failed, 4 a host unreachable; 6 (ours) a host's deploy lock is held.
EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_LOCKED = 0, 2, 4, 6


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
    reasons: dict[str, str] = field(default_factory=dict)
    diffs: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    commands: int = 0
    command_log: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host, "status": self.status.value, "message": self.message, "hint": self.hint,
            "changed_files": self.changed_files, "restarted": self.restarted, "started": self.started,
            "enabled": self.enabled, "pruned": self.pruned, "reasons": self.reasons, "diffs": self.diffs,
            "findings": [f.to_json() for f in self.findings], "evidence": self.evidence,
            "checks": [c.to_json() for c in self.checks],
            "remote_commands": self.commands, "seconds": round(self.seconds, 3),
        }


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


def exit_code(results: Sequence[HostResult]) -> int:
    statuses = {r.status for r in results}
    if Status.UNREACHABLE in statuses:
        return EXIT_UNREACHABLE
    if Status.FAILED in statuses:
        return EXIT_FAILED
    if Status.LOCKED in statuses:
        return EXIT_LOCKED
    return EXIT_OK
