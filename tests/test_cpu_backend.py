"""vLLM's CPU backend: the OMP binding helpers and the verify KV check against a `CPU KV cache size` line
(docs/vllm-facts.md#vllm-032-and-the-cpu-backend)."""

from __future__ import annotations

import pytest

from ernie_deploy.checks.logscan import check_startup_log
from ernie_deploy.planning.cpubackend import instance_binds, suggest_bind

# The one-line KV size of vLLM 0.32.0 on its CPU backend (kv_cache_utils.py:2327-2333) with the token count the CPU
# build logged for VLLM_CPU_KVCACHE_SPACE=1 at TP 1; the concurrency is what that pool gives at 4,096 tokens.
CPU_LINE = ("(EngineCore pid=2211) INFO 12-04 10:02:11 [kv_cache_utils.py:2327] CPU KV cache size: 58,240 tokens, "
            "Maximum concurrency for 4,096 tokens per request: 14.22x")
GPU_LINE = ("(EngineCore pid=14351) INFO 12-03 16:18:21 [kv_cache_utils.py:1169] GPU KV cache size: 2,259,904 tokens, "
            "Maximum concurrency for 4,096 tokens per request: 551.73x")


def kv(line: str, estimate: int | None) -> tuple[str, str]:
    (result,) = [r for r in check_startup_log([line], tp=1, max_model_len=None, kv_tokens_estimate=estimate)
                 if r.name == "kv_cache"]
    return result.status, result.summary


def test_verify_names_the_pool_the_line_names() -> None:
    status, summary = kv(CPU_LINE, 58240)
    assert status == "pass" and summary.startswith("CPU KV cache size 58,240 tokens (planner: 58,240, +0%)")
    assert kv(CPU_LINE, None)[1].startswith("CPU KV cache size 58,240 tokens")
    assert kv(GPU_LINE, 2_259_904)[1].startswith("GPU KV cache size 2,259,904 tokens")
    status, summary = kv(CPU_LINE, 116480)
    assert status == "warn" and summary.startswith("CPU KV cache size 58,240 tokens, planner estimated 116,480")


@pytest.mark.parametrize(("world", "value", "expected"), [
    (2, None, "0|1"),
    (2, "0-3", "0-1|2-3"),
    (2, "0-4", "0-2|3-4"),
    (3, "0,2,4,6,8,10", "0,2|4,6|8,10"),
    (4, "0|1", "0|1|2|3"),  # too few CPUs named to split: one each from 0
    (2, "a", "0|1"),
])
def test_suggested_binding_splits_the_cpus_named(world: int, value: str | None, expected: str) -> None:
    assert suggest_bind(world, value) == expected


def test_instance_binds() -> None:
    assert instance_binds(None, 2) == [None, None]
    assert instance_binds("0|1", 2) == ["0|1", "0|1"]
    assert instance_binds(["0", "1", "2"], 2) == ["0", "1"]
    assert instance_binds(["0"], 2) == ["0", None]
