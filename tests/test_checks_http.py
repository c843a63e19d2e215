"""HTTP judges, on the simulator's real-shaped answers (fixtures/logs/http-sim) and broken variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ernie_deploy.checks.http import (
    classify_health,
    completion_request,
    judge_completion,
    judge_models,
    parse_sse,
)
from ernie_deploy.checks.result import CheckInputError

HTTP = Path(__file__).parent / "fixtures" / "logs" / "http-sim"
MODELS = (HTTP / "sim-0.34.0-models.json").read_bytes()
COMPLETION = (HTTP / "sim-0.34.0-completion.json").read_bytes()
STREAM = (HTTP / "sim-0.34.0-completion-stream.txt").read_bytes()


@pytest.mark.parametrize(("status", "error", "want"), [
    (200, None, "ready"),
    (503, None, "dead"),
    (None, "[Errno 111] Connection refused", "loading"),
    (None, "ConnectionRefusedError", "loading"),
    (None, "timed out", "unknown"),
    (404, None, "unknown"),
    (None, None, "unknown"),
])
def test_classify_health(status: int | None, error: str | None, want: str) -> None:
    assert classify_health(status, error) == want


def test_completion_request_is_deterministic() -> None:
    assert completion_request("ernie") == {"model": "ernie", "prompt": "The capital of France is",
                                           "max_tokens": 8, "temperature": 0}
    assert completion_request("ernie", stream=True)["stream"] is True


def test_models_pass_and_mismatches() -> None:
    assert judge_models(MODELS, "ernie", 4096).status == "pass"
    assert judge_models(MODELS, "ernie", None).status == "pass"
    wrong_len = judge_models(MODELS, "ernie", 8192)
    assert wrong_len.status == "fail" and "max_model_len 4096, plan says 8192" in wrong_len.summary
    wrong_name = judge_models(MODELS, "ernie-4.5", 4096)
    assert wrong_name.status == "fail" and "['ernie']" in wrong_name.summary
    assert judge_models(b"<html>502</html>", "ernie", None).status == "fail"
    assert judge_models(b'{"object": "list"}', "ernie", None).status == "fail"


def test_completion_pass_and_failures() -> None:
    ok = judge_completion(200, COMPLETION, "ernie")
    assert ok.status == "pass" and "the ernie care" in ok.summary
    assert judge_completion(200, COMPLETION, "other").status == "fail"
    not_found = b'{"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "code": 404}}'
    r = judge_completion(404, not_found, "nope")
    assert r.status == "fail" and "HTTP 404" in r.summary and "does not exist" in r.evidence[0]
    doc = json.loads(COMPLETION)
    doc["choices"][0]["text"] = "  "
    assert judge_completion(200, json.dumps(doc).encode(), "ernie").summary == "the completion text is empty"
    doc["object"] = "chat.completion"
    assert judge_completion(200, json.dumps(doc).encode(), "ernie").status == "fail"
    assert judge_completion(200, b"{}", "ernie").status == "fail"


def test_parse_sse_and_streamed_completion() -> None:
    events = parse_sse(STREAM)
    assert [e["choices"][0]["text"] for e in events] == ["the", " ernie", " care"]
    r = judge_completion(200, STREAM, "ernie")
    assert r.status == "pass" and "'the ernie care'" in r.summary
    assert parse_sse(b"data: [DONE]\n\n") == []
    assert parse_sse(b'data: {"a":\ndata: 1}\n\n') == [{"a": 1}]  # multi-line data joins with "\n"
    with pytest.raises(CheckInputError, match="not JSON"):
        parse_sse(b"data: {oops\n\n")
