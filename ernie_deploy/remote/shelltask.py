"""A playbook's `command` task on a host: the operator's own shell text, recorded in the audit log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op


@dataclass(frozen=True)
class OperatorCommand(Intent):
    """Run `run`, append `audit` to the audit log, exit with `run`'s status."""

    op: ClassVar[Op] = Op.COMMAND
    run: str
    audit: dict[str, Any]

    def render(self) -> str:
        # The operator's command runs in a subshell, so its `exit` cannot skip the audit line.
        return f"( {self.run}\n)\nrc=$?\n{audit_line(self.audit)}\nexit $rc\n"


def command(run: str, audit: dict[str, Any], timeout: float) -> Command:
    return Command(OperatorCommand(run, audit), timeout=timeout, check=False)
