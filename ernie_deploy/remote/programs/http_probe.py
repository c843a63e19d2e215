"""The one HTTP client on a host: every request ernie-deploy makes of an instance is made here, on the instance's
own host (remote/http.py says why).

Two ways to run it. With no arguments it reads `{"requests": [...], "api_key": ..., "mark": ..., "limit": ...}`
as JSON on stdin (so an API key never appears on a command line), makes the requests in order, skipping one
whose `after` request did not answer 200, and prints one MARK line of JSON per answer, its body base64 and cut
at `limit` bytes. With arguments, `UNIT BIND PORT ...` triples (the facts script reads them from the installed
units), it asks each unit's /health on the address its host reaches it on and prints `UNIT STATUS` or
`UNIT error REASON` lines: the facts' fallback on a host without bash, which otherwise reads /health itself
(facts.health_script).

Quoted annotations: the host's python3 may be older than the `X | None` form.
"""

import base64
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from ernie_deploy.planning.hostpaths import local_url


def fetch(url: str, data: "bytes | None", headers: "dict[str, str]", timeout: float,
          limit: int) -> "dict[str, Any]":
    """One request: its status (None when no HTTP answer came), why it failed, the body and the timings."""
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    out: dict[str, Any] = {"status": None, "error": None, "first_byte": None}
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            first = resp.read(1)
            out["first_byte"] = time.monotonic() - t0
            body = first + resp.read(limit)
            out["status"] = resp.status
    except urllib.error.HTTPError as exc:
        body = exc.read(limit)
        out["status"] = exc.code
    except Exception as exc:
        body = b""
        out["error"] = str(getattr(exc, "reason", exc)) or type(exc).__name__
    out["seconds"] = time.monotonic() - t0
    out["body"] = body
    return out


def probe(spec: "dict[str, Any]") -> None:
    done: dict[str, int | None] = {}
    for r in spec["requests"]:
        if r.get("after") and done.get(r["after"]) != 200:
            continue
        headers = {"content-type": "application/json"} if r.get("data") is not None else {}
        if r.get("auth") and spec.get("api_key"):
            headers["authorization"] = "Bearer " + spec["api_key"]
        data = json.dumps(r["data"]).encode() if r.get("data") is not None else None
        out = fetch(r["url"], data, headers, r.get("timeout", 10), spec["limit"])
        out["id"] = r["id"]
        out["body"] = base64.b64encode(out["body"]).decode()
        done[r["id"]] = out["status"]
        sys.stdout.write(spec["mark"] + json.dumps(out) + "\n")
        sys.stdout.flush()


def health(triples: "list[str]") -> None:
    for i in range(0, len(triples) - 2, 3):
        unit, bind, port = triples[i:i + 3]
        out = fetch(local_url(bind, int(port)) + "/health", None, {}, 3, 0)
        if out["status"] is not None:
            print(unit, out["status"])
        else:
            print(unit, "error", out["error"].replace("\n", " "))


if __name__ == "__main__":
    if sys.argv[1:]:
        health(sys.argv[1:])
    else:
        probe(json.load(sys.stdin))
