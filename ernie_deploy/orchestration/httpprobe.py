"""Controller-side HTTP probes of a vLLM instance: /health, /v1/models, one small completion."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ernie_deploy.checks import http as judge


@dataclass(frozen=True)
class Answer:
    status: int | None
    body: bytes
    error: str | None
    seconds: float
    first_byte_seconds: float | None = None


def request(url: str, *, data: dict | None = None, api_key: str | None = None, timeout: float = 10.0) -> Answer:
    headers = {"content-type": "application/json"} if data is not None else {}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers=headers, method="POST" if data is not None else "GET")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            first = resp.read(1)
            first_at = time.monotonic() - started
            body = first + resp.read()
            return Answer(resp.status, body, None, time.monotonic() - started, first_at)
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read(), None, time.monotonic() - started)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Answer(None, b"", str(reason), time.monotonic() - started)


def base_url(address: str, port: int) -> str:
    return f"http://{address}:{port}"


def health(address: str, port: int) -> tuple[judge.Health, Answer]:
    answer = request(f"{base_url(address, port)}/health", timeout=5)
    return judge.classify_health(answer.status, answer.error), answer


def models(address: str, port: int, api_key: str | None) -> Answer:
    return request(f"{base_url(address, port)}/v1/models", api_key=api_key)


def completion(address: str, port: int, served_name: str, api_key: str | None, stream: bool) -> Answer:
    return request(f"{base_url(address, port)}/v1/completions", api_key=api_key, timeout=60,
                   data=judge.completion_request(served_name, stream=stream))
