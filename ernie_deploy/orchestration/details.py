"""The part of a host's result that belongs to one operation: what a deploy, restart or rollback changed, what
provisioning did, what status read. A host result carries at most one (results.py); the JSON documents render
each the same way whether the host was reached or not (an empty detail)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ernie_deploy.orchestration.steps import StepStatus


@dataclass
class Change:
    """What a deploy, restart or rollback did (or, in check mode, would do) to one host."""

    changed_files: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)  # installed units the plan no longer has
    dropins: list[str] = field(default_factory=list)  # drop-in files overriding managed units
    reasons: dict[str, str] = field(default_factory=dict)
    diffs: list[str] = field(default_factory=list)
    release: str | None = None
    batch: int | None = None  # the rollout batch the host was in (1-based)
    rollbacks: list[str] = field(default_factory=list)  # what was restored after a failure, and how it went


@dataclass
class ProvisionReport:
    """What provisioning did (or, in check mode, would do) on one host."""

    actions: list[dict[str, str]] = field(default_factory=list)
    vllm: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    driver: str | None = None

    def add(self, step: str, status: StepStatus, detail: str) -> None:
        self.actions.append({"step": step, "status": status, "detail": detail})

    def to_json(self) -> dict[str, Any]:
        return {"actions": self.actions, "vllm": self.vllm, "model": self.model, "driver": self.driver}


@dataclass(frozen=True)
class Drift:
    # file, daemon-reload, cmdline, not-applied, pending, drop-in, leftover, process, lock; balancer (an instance
    # as a balancer sees it), balancer-config (a balancer's live configuration)
    kind: str
    subject: str  # the file, unit or process
    message: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "subject": self.subject, "message": self.message, "fix": self.fix}


@dataclass
class StatusReport:
    """What runs on one host against its plan (`status`)."""

    instances: list[dict[str, Any]] = field(default_factory=list)
    drift: list[Drift] = field(default_factory=list)
    release: str | None = None
    last_change: dict[str, Any] | None = None
    lock: str | None = None
    vllm: str | None = None  # the version(s) the running processes use; the installed one when none runs
    vllm_installed: str | None = None  # the version at the default venv path

    def vllm_line(self) -> str:
        """The vLLM that serves, and the installed one beside it when they differ."""
        if self.vllm_installed is None or self.vllm == self.vllm_installed:
            return self.vllm or "?"
        return f"{self.vllm or '?'} running ({self.vllm_installed} installed)"

    def last_change_line(self) -> str:
        """The last audited change in one line; what an audit line lacks (older versions wrote some without
        user and controller) shows as "?", never as None."""
        last = self.last_change
        if not last:
            return "none recorded"
        time, user, command, action = (last.get(k) or "?" for k in ("time", "user", "command", "action"))
        return f"{time} {user} {command} ({action})"

    def to_json(self) -> dict[str, Any]:
        return {"instances": self.instances, "drift": [d.to_json() for d in self.drift], "release": self.release,
                "last_change": self.last_change, "lock": self.lock, "vllm": self.vllm,
                "vllm_installed": self.vllm_installed}


Detail = Change | ProvisionReport | StatusReport
