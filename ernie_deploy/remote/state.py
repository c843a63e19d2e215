"""The pending list on a host: units whose files were staged but not activated yet (the path and why in
planning/hostpaths.py)."""

from __future__ import annotations

import shlex

from ernie_deploy.planning.hostpaths import PENDING_FILE


def pending_add(entries: dict[str, str | None]) -> list[str]:
    """Shell lines marking units pending. Each line is `UNIT [RELEASE]`, RELEASE being what the unit ran when it
    was first marked: a unit staged twice before a restart still goes back to what really ran, so the first
    record of a unit is the one kept."""
    if not entries:
        return []
    lines = " ".join(shlex.quote(f"{u} {r}" if r else u) for u, r in sorted(entries.items()))
    return [f"printf '%s\\n' {lines} >> {PENDING_FILE}",
            f"awk '!seen[$1]++' {PENDING_FILE} > {PENDING_FILE}.new; mv -f {PENDING_FILE}.new {PENDING_FILE}"]


def pending_remove(units: tuple[str, ...] | list[str]) -> str:
    """A shell line taking units off the pending list (they run their files now, or were put back)."""
    names = shlex.quote(" ".join(units))
    return (f"if [ -f {PENDING_FILE} ]; then awk -v done={names} 'BEGIN {{ n = split(done, d, \" \"); "
            f"for (i = 1; i <= n; i++) skip[d[i]] = 1 }} !($1 in skip)' {PENDING_FILE} > {PENDING_FILE}.new; "
            f"mv -f {PENDING_FILE}.new {PENDING_FILE}; fi")
