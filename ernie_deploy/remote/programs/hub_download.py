"""Runs on the host with the venv's python (remote/hub.py): resolves a Hub revision to its commit and, unless the
host holds that commit intact already, downloads the snapshot with the Hub's own client and links each file
into the staging directory under its sha256. argv[1]: JSON settings (no secret); stdin: the token line. Prints
one `cfg["mark"]` line of JSON: the commit and files, or the error (the token redacted)."""

import hashlib
import json
import os
import sys
from typing import Any, NoReturn

cfg = json.loads(sys.argv[1])
token = sys.stdin.readline().rstrip("\n") or None
if cfg.get("endpoint"):
    os.environ["HF_ENDPOINT"] = cfg["endpoint"]
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def done(**out: Any) -> NoReturn:
    print(cfg["mark"] + json.dumps(out, sort_keys=True))
    sys.exit(0)


try:
    from huggingface_hub import HfApi, snapshot_download
except ImportError as e:
    done(error=f"huggingface_hub is not importable by {sys.executable} ({e})")
try:
    commit = HfApi(token=token).model_info(cfg["repo"], revision=cfg["revision"]).sha
    source = f"hf://{cfg['repo']}@{commit}"
    if source == cfg["recorded"] and cfg["intact"]:
        done(changed=False, commit=commit, source=source)
    local = os.path.join(cfg["stage"], "hub")
    os.makedirs(local, mode=0o700, exist_ok=True)
    snapshot_download(cfg["repo"], revision=commit, local_dir=local, token=token)
except Exception as e:
    done(error="{}: {}".format(type(e).__name__, str(e).replace(token or "\0", "[REDACTED]")))
files = {}
for base, dirs, names in os.walk(local):
    dirs[:] = sorted(d for d in dirs if d not in (".cache", ".git"))
    for name in sorted(names):
        path = os.path.join(base, name)
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        staged = os.path.join(cfg["stage"], h.hexdigest())
        if not os.path.exists(staged):
            os.link(path, staged)
        files[os.path.relpath(path, local)] = {"size": os.path.getsize(path), "sha256": h.hexdigest()}
done(changed=True, commit=commit, source=source, files=files)
