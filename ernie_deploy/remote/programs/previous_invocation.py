"""Runs on the host: the invocation before argv[1] among a unit's journal entries (`journalctl -o json` lines
on stdin, oldest first), or the last one when the current run has logged nothing yet (remote/logs.py)."""

import json
import sys

current = sys.argv[1]
seen: "list[str]" = []
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
