"""An instance's journal by invocation: the current run of its unit (what `systemctl status` calls the current
process and its children), or the run before it, as `journalctl -u` readers expect but without the lines of
older runs mixed in."""

from __future__ import annotations

import shlex

from ernie_deploy.remote.command import Command, Op

CURSOR = "-- cursor: "
# The invocation before `current` among the unit's journal entries, oldest first; the last one when the
# current run has logged nothing yet.
_PREVIOUS = r"""
import json, sys
current, seen = sys.argv[1], []
for line in sys.stdin:
    try:
        inv = json.loads(line).get("_SYSTEMD_INVOCATION_ID")
    except ValueError:
        continue
    if inv and (not seen or seen[-1] != inv):
        seen = [s for s in seen if s != inv] + [inv]
if current in seen:
    k = seen.index(current)
    print(seen[k - 1] if k > 0 else "")
else:
    print(seen[-1] if seen else "")
"""


def logs_command(unit: str, lines: int, previous: bool = False, cursor: str | None = None) -> Command:
    q = shlex.quote
    pick = (f"ID=$(journalctl -u {q(unit)} -o json --output-fields=_SYSTEMD_INVOCATION_ID --no-pager 2>/dev/null | "
            f"python3 -c {q(_PREVIOUS)} \"$ID\")\n") if previous else ""
    after = f" --after-cursor={q(cursor)}" if cursor else f" -n {int(lines)}"
    script = (f"ID=$(systemctl show -p InvocationID --value {q(unit)})\n{pick}"
              "if [ -z \"$ID\" ]; then echo 'no run of this unit in the journal' >&2; exit 3; fi\n"
              "printf 'invocation %s\\n' \"$ID\"\n"
              f"journalctl _SYSTEMD_INVOCATION_ID=\"$ID\" + INVOCATION_ID=\"$ID\"{after} -o short-iso --no-pager "
              "--show-cursor\n")
    return Command(Op.LOGS, script, check=False, units=(unit,))


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
