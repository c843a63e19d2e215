"""HTTP probes of a running instance, made on the host itself: the SSH session is the one network door.

The controller never opens a connection to a vLLM port: an instance bound to the host's loopback, or a
host reachable only through a jump host, is probed the same way. One small stdlib program (Python 3.6+,
which every vLLM host has) reads the requests as JSON on stdin, so an API key never appears on a command
line, makes them in order and prints one marked JSON line per answer. A request may name an earlier one
it needs: `/v1/models` and the smoke completion are only sent when `/health` answered 200.
"""

from __future__ import annotations

import base64
import json
import shlex
from dataclasses import dataclass
from typing import Any

MARK = "@@ernie-deploy:http "
BODY_LIMIT = 65536

# Runs on the host. Keep it stdlib-only and free of f-strings' newer forms: hosts may have an old python3.
PROGRAM = r"""
import base64, json, sys, time, urllib.request, urllib.error
LIMIT, MARK = @LIMIT@, @MARK@
spec = json.load(sys.stdin)
done = {}
for r in spec["requests"]:
    if r.get("after") and done.get(r["after"]) != 200:
        continue
    headers = {"content-type": "application/json"} if r.get("data") is not None else {}
    if r.get("auth") and spec.get("api_key"):
        headers["authorization"] = "Bearer " + spec["api_key"]
    data = json.dumps(r["data"]).encode() if r.get("data") is not None else None
    req = urllib.request.Request(r["url"], data=data, headers=headers, method="POST" if data else "GET")
    out = {"id": r["id"], "status": None, "error": None, "first_byte": None}
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=r.get("timeout", 10)) as resp:
            first = resp.read(1)
            out["first_byte"] = time.monotonic() - t0
            body = first + resp.read(LIMIT)
            out["status"] = resp.status
    except urllib.error.HTTPError as exc:
        body = exc.read(LIMIT)
        out["status"] = exc.code
    except Exception as exc:
        body = b""
        out["error"] = str(getattr(exc, "reason", exc)) or type(exc).__name__
    out["seconds"] = time.monotonic() - t0
    out["body"] = base64.b64encode(body).decode()
    done[r["id"]] = out["status"]
    sys.stdout.write(MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
""".replace("@LIMIT@", str(BODY_LIMIT)).replace("@MARK@", repr(MARK))


@dataclass(frozen=True)
class Request:
    id: str
    url: str
    data: dict[str, Any] | None = None
    auth: bool = False
    after: str | None = None
    timeout: float = 10.0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "data": self.data, "auth": self.auth, "after": self.after,
                "timeout": self.timeout}


@dataclass(frozen=True)
class Answer:
    status: int | None
    body: bytes
    error: str | None
    seconds: float
    first_byte_seconds: float | None = None


def base_url(address: str, port: int) -> str:
    host = "127.0.0.1" if address in ("0.0.0.0", "") else "::1" if address == "::" else address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def script() -> str:
    """The shell line that runs the probe program on the host (its requests come on stdin)."""
    return (f"if command -v python3 >/dev/null; then python3 -c {shlex.quote(PROGRAM)}; "
            f"else printf '{MARK}%s\\n' '{{\"id\": \"*\", \"error\": \"python3 not found on the host\"}}'; fi\n")


def stdin(requests: list[Request], api_key: str | None) -> bytes:
    return json.dumps({"requests": [r.to_json() for r in requests], "api_key": api_key}).encode()


def parse(text: str) -> dict[str, Answer]:
    """Answers by request id; a request that was not sent (its `after` failed) is absent."""
    answers: dict[str, Answer] = {}
    for line in text.splitlines():
        if not line.startswith(MARK):
            continue
        try:
            data = json.loads(line[len(MARK):])
            answers[str(data["id"])] = Answer(
                data.get("status"), base64.b64decode(data.get("body") or ""), data.get("error"),
                float(data.get("seconds") or 0.0), data.get("first_byte"))
        except (ValueError, KeyError, TypeError):
            continue
    return answers


def missing(answers: dict[str, Answer], request_id: str) -> Answer:
    """The answer to a request, or why there is none (the host could not run the probe at all)."""
    if request_id in answers:
        return answers[request_id]
    everything = answers.get("*")
    return Answer(None, b"", everything.error if everything else "no answer from the probe", 0.0)
