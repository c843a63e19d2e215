"""The lab's load-balancer hook: `rotation.py FILE remove|add` takes $ERNIE_ADDRESS:$ERNIE_PORT out of (or back
into) the JSON rotation file the load generator reads, atomically. After a removal it waits a moment, as a
real balancer needs to stop routing (the preStop sleep of KServe PR #5496). Each change is appended to
FILE.events."""

import fcntl
import json
import os
import sys
import time
from pathlib import Path

path, action = Path(sys.argv[1]), sys.argv[2]
backend = f"{os.environ['ERNIE_ADDRESS']}:{os.environ['ERNIE_PORT']}"
with open(f"{path}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    current = json.loads(path.read_text())
    wanted = [b for b in current if b != backend] + ([backend] if action == "add" else [])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(wanted))
    os.replace(tmp, path)
    # When each backend left or rejoined the rotation (wall clock), so a test can find the requests in flight.
    with open(f"{path}.events", "a") as events:
        events.write(json.dumps({"t": time.time(), "backend": backend, "action": action}) + "\n")
if action == "remove":
    time.sleep(0.3)
