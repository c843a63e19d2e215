"""HTTP probes of a running instance, made on the host itself: the SSH session is the one network door.

The controller never opens a connection to a vLLM port: an instance bound to the host's loopback, or a
host reachable only through a jump host, is probed the same way. One small stdlib program
(programs/http_probe.py, run by the host's python3; the facts' /health reads use it only where the host has no
bash: remote/facts.py health_script) reads the requests
as JSON on stdin, so an API key never appears on a command line, makes them in order and prints one marked
JSON line per answer. A request may name an earlier one it needs: `/v1/models` and the smoke completion are
only sent when `/health` answered 200.
"""

from __future__ import annotations

import base64
import json
import shlex
from dataclasses import dataclass
from typing import Any

from ernie_deploy.remote.programs import program
from ernie_deploy.remote.protocol import marker, records

MARK = marker("http")  # one answer, as JSON
BODY_LIMIT = 65536
PROGRAM = program("http_probe")


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


def script() -> str:
    """The shell line that runs the probe program on the host (its requests come on stdin)."""
    return (f"if command -v python3 >/dev/null; then python3 -c {shlex.quote(PROGRAM)}; "
            f"else printf '{MARK}%s\\n' '{{\"id\": \"*\", \"error\": \"python3 not found on the host\"}}'; fi\n")


def stdin(requests: list[Request], api_key: str | None) -> bytes:
    return json.dumps({"requests": [r.to_json() for r in requests], "api_key": api_key, "mark": MARK,
                       "limit": BODY_LIMIT}).encode()


def parse(text: str) -> dict[str, Answer]:
    """Answers by request id; a request that was not sent (its `after` failed) is absent."""
    answers: dict[str, Answer] = {}
    for record in records(text, "http"):
        try:
            data = json.loads(record)
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
