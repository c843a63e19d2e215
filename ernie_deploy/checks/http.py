"""Judges of vLLM's HTTP answers (docs/vllm-facts.md#http-endpoints). The caller makes the requests; nothing here does.

`/health` answers 200 with an empty body when ready and 503 once the engine died; while the model loads
nothing listens on the port, so a connection is refused rather than answered.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from ernie_deploy.checks.result import CheckInputError, CheckResult

Health = Literal["loading", "ready", "dead", "unknown"]

PROMPT = "The capital of France is"


def classify_health(status: int | None, error: str | None) -> Health:
    """What one `/health` probe says about the instance.

    Connection refused means the port is bound but not yet listening (still loading) — or nothing runs
    at all; the caller tells those apart by the unit's state. A timeout or reset says nothing certain.
    """
    if status == 200:
        return "ready"
    if status == 503:
        return "dead"
    if status is None and error:
        text = error.lower()
        if "refused" in text or "errno 111" in text or "econnrefused" in text:
            return "loading"
    return "unknown"


def completion_request(served_name: str, *, stream: bool = False) -> dict[str, Any]:
    """A deterministic `/v1/completions` body: greedy, 8 tokens, so reruns compare equal."""
    body: dict[str, Any] = {"model": served_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    if stream:
        body["stream"] = True
    return body


def _json(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckInputError(f"not JSON: {body[:200]!r}") from exc


def _quote(body: bytes, limit: int = 300) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "…"


def judge_models(body: bytes, served_name: str, max_model_len: int | None, *,
                 instance: str | None = None) -> CheckResult:
    """`GET /v1/models`: the served name is listed, with the plan's max_model_len when the plan sets one."""
    name = "http_models"
    try:
        doc = _json(body)
        data = doc["data"]
        models = {m["id"]: m for m in data}
    except (CheckInputError, KeyError, TypeError) as exc:
        return CheckResult(name, "fail", f"/v1/models is not an OpenAI model list ({exc})", (_quote(body),),
                           cause="something other than vLLM answers on the port, or a proxy rewrote the answer",
                           instance=instance)
    if served_name not in models:
        return CheckResult(name, "fail", f"/v1/models lists {sorted(models)}, not {served_name!r}", (_quote(body),),
                           cause="the unit serves another --served-model-name (or another instance owns the port)",
                           fix=f"re-render the unit with --served-model-name {served_name}", instance=instance)
    actual = models[served_name].get("max_model_len")
    if max_model_len is not None and actual != max_model_len:
        return CheckResult(name, "fail", f"/v1/models: {served_name} has max_model_len {actual}, plan says "
                           f"{max_model_len}", (_quote(body),), cause="the unit runs with another --max-model-len",
                           fix=f"re-render and restart with --max-model-len {max_model_len}", instance=instance)
    return CheckResult(name, "pass", f"/v1/models lists {served_name} (max_model_len {actual})", (_quote(body),),
                       instance=instance)


def parse_sse(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of a streamed completion (`data: {...}` blocks, ending with `data: [DONE]`)."""
    events: list[dict[str, Any]] = []
    data: list[str] = []
    for raw in [*body.decode("utf-8").splitlines(), ""]:
        line = raw.rstrip("\r")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            # A blank line ends an event; multi-line data joins with newlines (the SSE spec).
            payload = "\n".join(data)
            data = []
            if payload.strip() == "[DONE]":
                continue
            try:
                event = json.loads(payload)
            except json.JSONDecodeError as exc:
                raise CheckInputError(f"SSE event is not JSON: {payload[:200]!r}") from exc
            if not isinstance(event, dict):
                raise CheckInputError(f"SSE event is not an object: {payload[:200]!r}")
            events.append(event)
    return events


def not_generating(seconds: float, *, instance: str | None = None, fix: str | None = None) -> CheckResult:
    """A completion that got no answer in time from an instance whose /health answered 200: vLLM took the
    request and its engine produced nothing (hung), which is neither a rejection nor the network."""
    return CheckResult("http_completion", "fail", f"not generating: /v1/completions got no answer within "
                       f"{seconds:.0f} s while /health answered 200",
                       cause="the engine is hung: the API server accepts requests and answers /health, the engine "
                             "produces no token", fix=fix, instance=instance)


def judge_completion(status: int, body: bytes, served_name: str, *, instance: str | None = None) -> CheckResult:
    """`POST /v1/completions`: 200, OpenAI completion shape, non-empty text, `model` = the served name.

    A streamed answer (SSE) is judged on its joined text and the model of its chunks.
    """
    name = "http_completion"
    quoted = (_quote(body),)
    if 400 <= status < 500:
        return CheckResult(name, "fail", f"/v1/completions answered HTTP {status}", quoted,
                           cause="vLLM rejected the request (401: API key; 404: unknown model name; 400: too long)",
                           instance=instance)
    if status != 200:
        return CheckResult(name, "fail", f"/v1/completions answered HTTP {status}", quoted,
                           cause="vLLM failed the request (a 500 with EngineDeadError: its engine died or is "
                                 "stopping)", fix="read the journal for why the engine died", instance=instance)
    try:
        if body.lstrip().startswith(b"data:"):
            chunks = parse_sse(body)
            models = {c.get("model") for c in chunks}
            text = "".join(str(c["choices"][0].get("text") or "") for c in chunks if c.get("choices"))
            model = models.pop() if len(models) == 1 else None
            shape_ok = bool(chunks) and all(c.get("object") == "text_completion" for c in chunks)
        else:
            doc = _json(body)
            text = doc["choices"][0]["text"]
            model = doc.get("model")
            shape_ok = doc.get("object") == "text_completion"
    except (CheckInputError, KeyError, IndexError, TypeError) as exc:
        return CheckResult(name, "fail", f"/v1/completions answer is not an OpenAI completion ({exc})", quoted,
                           instance=instance)
    if not shape_ok:
        return CheckResult(name, "fail", "/v1/completions answer has no object 'text_completion'", quoted,
                           instance=instance)
    if model != served_name:
        return CheckResult(name, "fail", f"completion came from model {model!r}, expected {served_name!r}", quoted,
                           instance=instance)
    if not isinstance(text, str) or not text.strip():
        return CheckResult(name, "fail", "the completion text is empty", quoted,
                           cause="the model produced no tokens (EOS at once or a broken tokenizer/weights)",
                           instance=instance)
    return CheckResult(name, "pass", f"{served_name} completed {PROMPT!r} with {text!r}", quoted, instance=instance)
