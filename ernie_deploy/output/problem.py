"""The one way a host that failed or could not be reached is told, in every command: `HOST: KIND: WHAT`, then
`  fix: HINT` (a remote error's message starts with its kind: unreachable, failed, timeout). Lines that lead with
the status (deploy's `unreachable: HOST (2.7s) ...`) take the message without its kind said a second time."""

from __future__ import annotations


def host_problem(host: str, message: str, hint: str | None, *, indent: str = "") -> str:
    text = f"{indent}{host}: {message.removeprefix(f'{host}: ')}"
    return text + (f"\n{indent}  fix: {hint}" if hint else "")


def said(status: str, message: str) -> str:
    """`message` after a line that already named `status` (and the host): its kind not repeated."""
    return message.removeprefix(f"{status}: ")
