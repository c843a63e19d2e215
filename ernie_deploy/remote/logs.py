"""An instance's journal by invocation: the current run of its unit (what `systemctl status` calls the current
process and its children), or the run before it, as `journalctl -u` readers expect but without the lines of
older runs mixed in."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import ClassVar

from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.programs import program

CURSOR = "-- cursor: "
_PREVIOUS = program("previous_invocation")


@dataclass(frozen=True)
class Logs(Intent):
    """The journal of `unit`'s current run (or, `previous`, the run before it): the last `lines` lines, or
    those after `cursor`."""

    op: ClassVar[Op] = Op.LOGS
    unit: str
    lines: int
    previous: bool = False
    cursor: str | None = None

    def render(self) -> str:
        q = shlex.quote
        pick = (f"ID=$(journalctl -u {q(self.unit)} -o json --output-fields=_SYSTEMD_INVOCATION_ID --no-pager "
                f"2>/dev/null | python3 -c {q(_PREVIOUS)} \"$ID\")\n") if self.previous else ""
        after = f" --after-cursor={q(self.cursor)}" if self.cursor else f" -n {int(self.lines)}"
        return (f"ID=$(systemctl show -p InvocationID --value {q(self.unit)})\n{pick}"
                "if [ -z \"$ID\" ]; then echo 'no run of this unit in the journal' >&2; exit 3; fi\n"
                "printf 'invocation %s\\n' \"$ID\"\n"
                f"journalctl _SYSTEMD_INVOCATION_ID=\"$ID\" + INVOCATION_ID=\"$ID\"{after} -o short-iso "
                "--no-pager --show-cursor\n")


def logs_command(unit: str, lines: int, previous: bool = False, cursor: str | None = None) -> Command:
    return Command(Logs(unit, lines, previous, cursor), check=False)


def split(text: str) -> tuple[str | None, list[str], str | None]:
    """(invocation id, journal lines, cursor to continue after)."""
    lines = text.splitlines()
    invocation = None
    if lines and lines[0].startswith("invocation "):
        invocation = lines.pop(0).split(" ", 1)[1].strip()
    cursor = None
    if lines and lines[-1].startswith(CURSOR):
        cursor = lines.pop().removeprefix(CURSOR).strip()
    return invocation, [line for line in lines if line != "-- No entries --"], cursor
