"""The progress check's pure core: parsing a /metrics page into a reading, the thresholds' inventory variables,
and the judgement of two readings (checks/progress.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from ernie_deploy.checks.progress import (
    MetricsError,
    Progress,
    Reading,
    Thresholds,
    has_work,
    judge,
    needs_second_reading,
    parse_reading,
    thresholds_of,
)
from ernie_deploy.errors import InventoryError

REAL = Path(__file__).parent / "fixtures/real-vllm/0.32.0/http/metrics.txt"
TH = Thresholds()


def page(running: float, waiting: float, generated: float, *, engines: int = 1, kv: float = 0.25) -> str:
    lines = ["# TYPE vllm:num_requests_running gauge"]
    for e in range(engines):
        labels = f'{{engine="{e}",model_name="ernie"}}'
        lines += [f"vllm:num_requests_running{labels} {running}", f"vllm:num_requests_waiting{labels} {waiting}",
                  f"vllm:generation_tokens_total{labels} {generated}",
                  f"vllm:kv_cache_usage_perc{labels} {kv * (e + 1)}",
                  f"vllm:generation_tokens_created{labels} 1.79e+09"]
    return "\n".join(lines) + "\n"


def test_real_vllm_page_parses() -> None:
    r = parse_reading(REAL.read_text())
    assert r == Reading(running=0.0, waiting=0.0, generated=14.0, kv_usage=0.0)


def test_engines_and_models_are_summed_kv_is_the_fullest() -> None:
    r = parse_reading(page(2, 1, 100, engines=2, kv=0.3))
    assert (r.running, r.waiting, r.generated) == (4, 2, 200)
    assert r.kv_usage == pytest.approx(0.6)


@pytest.mark.parametrize("text, words", [
    ("", "no vLLM metrics"),
    ("<html><body>404 Not Found</body></html>", "no vLLM metrics"),
    ("# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 3.0\n", "no vLLM metrics"),
    ('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n',
     "lacks vllm:generation_tokens_total"),
    ('vllm:num_requests_running 1\nvllm:num_requests_waiting NaN\nvllm:generation_tokens_total 1\n', "not a finite"),
])
def test_not_a_vllm_page_is_a_named_error(text: str, words: str) -> None:
    with pytest.raises(MetricsError, match=words):
        parse_reading(text)


def test_kv_usage_absent_is_none() -> None:
    text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 5\n"
    assert parse_reading(text).kv_usage is None


def test_thresholds_defaults_and_inventory_values() -> None:
    assert thresholds_of("gpu-1", {}) == Thresholds(5.0, 1, 1)
    th = thresholds_of("gpu-1", {"vllm_progress_window": 2, "vllm_progress_min_tokens": 10,
                                 "vllm_progress_stuck_growth": 0.5, "vllm_port": 8000})
    assert th == Thresholds(window_s=2.0, min_tokens=10.0, stuck_growth=0.5)


@pytest.mark.parametrize("var, value, words", [
    ("vllm_progress_window", 0, "above 0 and at most 3600"),
    ("vllm_progress_window", 86400, "at most 3600"),
    ("vllm_progress_window", "5s", "must be a number, got str"),
    ("vllm_progress_min_tokens", -1, "above 0"),
    ("vllm_progress_stuck_growth", True, "must be a number, got bool"),
    ("vllm_progress_min_tokens", float("nan"), "above 0"),
])
def test_bad_threshold_names_host_variable_and_fix(var: str, value: object, words: str) -> None:
    with pytest.raises(InventoryError, match=words) as exc:
        thresholds_of("gpu-1", {var: value})
    assert exc.value.where == "gpu-1"
    assert var in exc.value.message
    assert exc.value.hint is not None and exc.value.hint.startswith(f"set {var} to ")


def test_every_bad_threshold_is_named_at_once() -> None:
    with pytest.raises(InventoryError, match="2 problems") as exc:
        thresholds_of("gpu-1", {"vllm_progress_window": -1, "vllm_progress_stuck_growth": "x"})
    assert "vllm_progress_window" in exc.value.message and "vllm_progress_stuck_growth" in exc.value.message


def r(running: float, waiting: float, generated: float, kv: float | None = None) -> Reading:
    return Reading(running, waiting, generated, kv)


def test_running_without_new_tokens_is_stalled_with_readings_and_fix() -> None:
    p = judge(r(2, 0, 140, 0.5), r(2, 1, 140, 0.5), TH, host="gpu-1", instance="1")
    assert p.state == "stalled" and not p.healthy()
    assert "running 2→2, waiting 0→1, generated 140→140 tokens over 5 s, KV cache 50%→50%" in p.evidence
    assert p.fix is not None
    assert "ernie-deploy restart -i INV -l gpu-1 --instance 1" in p.fix
    assert "ernie-deploy watch -i INV -l gpu-1 --restart-stalled" in p.fix
    assert "ernie-deploy logs -i INV gpu-1 --instance 1" in p.fix


def test_min_tokens_is_the_bar() -> None:
    th = Thresholds(min_tokens=10)
    assert judge(r(1, 0, 100), r(1, 0, 109), th).state == "stalled"
    assert judge(r(1, 0, 100), r(1, 0, 110), th).state == "ok"


def test_tokens_flowing_is_ok() -> None:
    p = judge(r(3, 2, 100), r(3, 2, 160), TH)
    assert p.state == "ok" and p.healthy() and p.fix is None


def test_requests_finishing_or_arriving_between_readings_is_not_stalled() -> None:
    # Running in only one reading: the batch finished, or work just arrived; neither shows a hang.
    assert judge(r(1, 0, 100), r(0, 0, 100), TH).state == "ok"
    assert judge(r(0, 0, 100), r(1, 0, 100), TH).state == "ok"


def test_growing_queue_with_nothing_running_is_stuck() -> None:
    p = judge(r(0, 1, 50), r(0, 3, 50), TH, host="gpu-2", instance="vllm-0")
    assert p.state == "stuck" and not p.healthy()
    assert "waiting 1→3" in p.evidence and p.fix is not None and "restart -i INV -l gpu-2 --instance vllm-0" in p.fix
    # Growth below the bar, or a queue that does not grow, is not stuck.
    assert judge(r(0, 1, 50), r(0, 3, 50), Thresholds(stuck_growth=3)).state == "ok"
    assert judge(r(0, 2, 50), r(0, 2, 50), TH).state == "ok"


def test_counter_going_back_is_a_restart_not_a_stall() -> None:
    p = judge(r(1, 0, 500), r(1, 0, 3), TH)
    assert p.state == "ok" and "restarted" in p.evidence


def test_idle_from_one_reading_needs_no_second() -> None:
    before = r(0, 0, 14)
    assert not needs_second_reading(before)
    p = judge(before, None, TH)
    assert p.state == "idle" and p.healthy() and p.after is None and p.before == before
    assert judge(before, r(0, 0, 14), TH).state == "idle"


def test_work_needs_a_second_reading() -> None:
    assert needs_second_reading(r(1, 0, 0)) and needs_second_reading(r(0, 1, 0))
    assert not needs_second_reading(MetricsError("x"))
    with pytest.raises(ValueError, match="needs a second reading"):
        judge(r(1, 0, 0), None, TH)


def test_unreadable_either_reading_is_never_healthy() -> None:
    first = judge(MetricsError("HTTP 404"), None, TH, host="gpu-1", instance="0")
    assert first.state == "unreadable" and not first.healthy()
    assert "first reading: HTTP 404" in first.evidence
    assert first.fix is not None and "ernie-deploy logs -i INV gpu-1 --instance 0" in first.fix
    second = judge(r(1, 0, 5), MetricsError("connection refused"), TH)
    assert second.state == "unreadable" and "second reading: connection refused" in second.evidence
    assert second.before == r(1, 0, 5) and second.after is None


@pytest.mark.parametrize("text, work", [
    (page(0, 0, 5), False),
    (page(1, 0, 5), True),
    (page(0, 2, 5), True),
    ("vllm:num_requests_running 0\nvllm:num_requests_waiting 3 1700000000000\n", True),  # with a timestamp
    ('vllm:num_requests_running{model_name="a} 1"} 0.0\n', False),  # a brace inside a label value
    ('vllm:num_requests_running{model_name="a"} NaN\n', True),  # a doubt costs a wait
    ('vllm:num_requests_running{model_name="a"}\n', True),
    ("vllm:num_requests_waiting_by_reason 4\nvllm:generation_tokens_total 9\n", False),
    ("", False),
])
def test_has_work_agrees_with_the_reading(text: str, work: bool) -> None:
    assert has_work(text, "vllm:num_requests_running", "vllm:num_requests_waiting") is work
    with contextlib.suppress(MetricsError):  # not a full page: only the host's decision matters
        assert needs_second_reading(parse_reading(text)) is work


def test_to_json() -> None:
    p = judge(r(1, 0, 5, 0.1), r(1, 0, 5, 0.2), TH)
    doc = p.to_json()
    assert doc["state"] == "stalled" and doc["healthy"] is False and doc["fix"]
    assert doc["before"] == {"running": 1, "waiting": 0, "generated": 5, "kv_usage": 0.1}
    assert doc["after"]["kv_usage"] == 0.2
    assert Progress("idle", "e", None, None, None).to_json()["before"] is None
