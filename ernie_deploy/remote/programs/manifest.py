"""Runs on the host after a directory sync's exchange (remote/filesync.py): writes the directory's new manifest,
atomically, from the entries sent (argv[1]: a JSON file of `{"source", "files": {rel: {size, sha256}}}`) and
`find`'s view of the switched-in files on stdin (`SIZE MTIME REL` lines: their sizes and mtimes as the next
probe will see them). argv[2]: the manifest's path."""

import json
import os
import sys

with open(sys.argv[1]) as fh:
    entries = json.loads(fh.read())
files = {}
for line in sys.stdin.read().splitlines():
    size, mtime, rel = line.split(" ", 2)
    if rel in entries["files"] and int(size) == entries["files"][rel]["size"]:
        files[rel] = {"size": int(size), "sha256": entries["files"][rel]["sha256"], "mtime": mtime}
out = sys.argv[2]
os.makedirs(os.path.dirname(out), mode=0o700, exist_ok=True)
with open(out + ".tmp", "w") as fh:
    json.dump({"source": entries["source"], "files": files}, fh, sort_keys=True)
os.replace(out + ".tmp", out)
