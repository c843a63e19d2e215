"""The value every check returns, and the error raised when a command's output cannot be read at all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ernie_deploy.errors import DeployError

Status = Literal["pass", "fail", "warn"]

_RANK: dict[str, int] = {"pass": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class CheckResult:
    """One verdict with the lines that prove it; `cause`/`fix` are filled when something is wrong."""

    name: str
    status: Status
    summary: str
    evidence: tuple[str, ...] = ()
    cause: str | None = None
    fix: str | None = None
    instance: str | None = None

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "instance": self.instance,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "cause": self.cause,
            "fix": self.fix,
        }


def worst(results: Iterable[CheckResult]) -> Status:
    """The most severe status among results ("pass" for none)."""
    status: Status = "pass"
    for r in results:
        if _RANK[r.status] > _RANK[status]:
            status = r.status
    return status


class CheckInputError(DeployError):
    """A command's output is not in the format the parser was written for (wrong flags, truncated output)."""
