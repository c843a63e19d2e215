"""Two readings of each instance's /metrics a window apart, made on the host (orchestration/progress.py).

Reads `{"instances": [{"id", "url"}], "api_key", "window", "timeout", "limit", "families", "running",
"waiting", "mark"}` as JSON on stdin (an API key never appears on a command line; vLLM serves /metrics without
one, a proxy in front may not), reads every instance's page once, then, only when some page shows requests
running or waiting, sleeps `window` seconds and reads those pages again: an idle host costs no wait. Prints one
MARK line of JSON per reading: `{"id", "round", "status", "error", "seconds", "body"}`, the body cut to the
lines of `families` (the rest of a vLLM page is histograms the judgement does not read).

An instance whose page shows no work gets one small completion (its `probe`: url and body, answered within
`probe_timeout` seconds), round 0 in the output with its status, error and seconds: an engine that hung while
idle keeps its gauges at 0, and only a request shows that nothing comes out. The probes run alongside the
window's wait, so they add no time to a busy host and at most `probe_timeout` to an idle one.

Quoted annotations: the host's python3 may be older than the `X | None` form.
"""

import json
import sys
import threading
import time
import urllib.error  # fetch's: the text sent to the host carries fetch's source in place of its import
import urllib.request  # noqa: F401
from typing import Any

from ernie_deploy.checks.progress import has_work
from ernie_deploy.remote.programs.http_probe import fetch


def kept(body: bytes, families: "list[str]") -> str:
    """The page's sample lines of `families` (a family's name then `{` or a space)."""
    starts = tuple(f + "{" for f in families) + tuple(f + " " for f in families)
    return "".join(line + "\n" for line in body.decode("utf-8", "replace").splitlines() if line.startswith(starts))


def read(spec: "dict[str, Any]", inst: "dict[str, str]", round_: int) -> "dict[str, Any]":
    headers = {"authorization": "Bearer " + spec["api_key"]} if spec.get("api_key") else {}
    out = fetch(inst["url"], None, headers, spec["timeout"], spec["limit"])
    out["body"] = kept(out["body"], spec["families"]) if out["status"] == 200 else ""
    out.update(id=inst["id"], round=round_)
    sys.stdout.write(spec["mark"] + json.dumps(out) + "\n")
    sys.stdout.flush()
    return out


def probe(spec: "dict[str, Any]", inst: "dict[str, Any]", lock: threading.Lock) -> None:
    headers = {"content-type": "application/json"}
    if spec.get("api_key"):
        headers["authorization"] = "Bearer " + spec["api_key"]
    out = fetch(inst["probe"]["url"], json.dumps(inst["probe"]["body"]).encode(), headers, spec["probe_timeout"],
                spec["limit"])
    out.update(id=inst["id"], round=0, body="")
    with lock:
        sys.stdout.write(spec["mark"] + json.dumps(out) + "\n")
        sys.stdout.flush()


def main(spec: "dict[str, Any]") -> None:
    lock = threading.Lock()
    busy, probes = [], []
    for inst in spec["instances"]:
        with lock:
            first = read(spec, inst, 1)
        if has_work(first["body"], spec["running"], spec["waiting"]):
            busy.append(inst)
        elif first["status"] == 200 and inst.get("probe"):
            probes.append(threading.Thread(target=probe, args=(spec, inst, lock), daemon=True))
    for thread in probes:
        thread.start()
    if busy:
        time.sleep(spec["window"])
        for inst in busy:
            with lock:
                read(spec, inst, 2)
    for thread in probes:
        thread.join()


if __name__ == "__main__":
    main(json.load(sys.stdin))
