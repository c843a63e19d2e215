"""Findings: what the planner says about a plan, each with a severity and a concrete fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Severity(Enum):
    ERROR = "error"  # vLLM would refuse to start (or ernie-deploy refuses to deploy)
    WARNING = "warning"  # might work; ernie-deploy cannot be sure
    ADVICE = "advice"  # works, but a better layout exists
    INFO = "info"  # facts worth seeing (memory headroom)


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    message: str
    fix: str | None = None
    vllm_message: str | None = None
    instance: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {
            "severity": self.severity.value,
            "code": self.code,
            "instance": self.instance,
            "message": self.message,
            "vllm_message": self.vllm_message,
            "fix": self.fix,
        }
