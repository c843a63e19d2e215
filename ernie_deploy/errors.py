"""The one error type users see, and the exit codes every command shares.

Every error names where it happened (a host, or a file with line and key path) and what to do next.
The CLI prints it on one line plus the hint; tracebacks only with -vvv.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes, ansible-playbook's where they overlap (2 a host failed, 4 unreachable); README's table."""

    OK = 0
    PLAN_ERRORS = 1  # plan / render: a host's plan has errors (deploy and verify report such a host as failed)
    FAILED = 2  # a host failed (deploy, verify)
    UNREACHABLE = 4
    INPUT = 5  # bad input or usage: inventory, data file, template, playbook, arguments
    LOCKED = 6  # a host's deploy lock is held by another run
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
    TERMINATED = 143  # SIGTERM (128 + SIGTERM); SIGHUP gives 129
    BROKEN_PIPE = 141  # the output's reader went away (`| head`): 128 + SIGPIPE, as a shell reports such a stop


class DeployError(Exception):
    """A problem the user can act on.

    `where` is a host name or `file:line: key.path`; `hint` is the next step ("set ... to ...").
    """

    # What a command exits with when this error ends it; a subclass for a host's failure sets its own
    # (remote/ssh.py's RemoteError by its kind), so every command maps errors by README's table in one place.
    exit_code: ExitCode = ExitCode.INPUT

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
