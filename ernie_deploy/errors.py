"""The one error type users see.

Every error names where it happened (a host, or a file with line and key path) and what to do next.
The CLI prints it on one line plus the hint; tracebacks only with -vvv.
"""

from __future__ import annotations


class DeployError(Exception):
    """A problem the user can act on.

    `where` is a host name or `file:line: key.path`; `hint` is the next step ("set ... to ...").
    """

    exit_code = 1

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text


class InventoryError(DeployError):
    """Malformed inventory, group_vars/host_vars or --limit pattern."""


class ConfigError(DeployError):
    """Malformed data file: recommendation table, GPU catalog, model config, playbook."""


class RenderError(DeployError):
    """A value that cannot be placed safely into a unit file or a shell command."""
