import pytest

from ernie_deploy.planning.memory import GIB, estimate, estimate_cpu, kv_layout
from ernie_deploy.planning.models import bundled_model

A10 = 23028 * 2**20
ERNIE = bundled_model("ERNIE-4.5-0.3B-PT")


def est(tp: int, mml: int, total: int = A10, util: float = 0.9):  # type: ignore[no-untyped-def]
    assert ERNIE is not None
    return estimate(ERNIE, gpu_name="NVIDIA A10", gpu_total_bytes=total, utilization=util, tp=tp, pp=1,
                    max_model_len=mml)


@pytest.mark.parametrize(("tp", "per_token", "heads", "replicas"),
                         [(1, 18432, 2, 1), (2, 9216, 1, 1), (4, 9216, 1, 2), (8, 9216, 1, 4)])
def test_kv_bytes_per_token_and_head_replication(tp: int, per_token: int, heads: int, replicas: int) -> None:
    # docs/vllm-facts.md#memory-model: 2·18·2·128·2 = 18,432 B at TP 1; KV heads replicate beyond TP 2,
    # so no further savings
    e = est(tp, 4096)
    assert e.kv_bytes_per_token == per_token
    assert ERNIE is not None and kv_layout(ERNIE, tp) == (heads, replicas)


def test_full_context_needs_2_25_gib_and_about_8x_on_one_a10() -> None:
    e = est(1, 131072)
    assert e.one_sequence_bytes == int(2.25 * GIB)
    assert 7.5 < e.max_concurrency < 9  # docs/vllm-facts.md#memory-model expects ≈ 8x
    assert e.fits


def test_concurrency_is_blocks_over_blocks_per_sequence() -> None:
    e = est(1, 4096)
    assert e.max_concurrency == pytest.approx(e.kv_tokens / 4096)
    assert e.kv_tokens % 16 == 0


def test_tiny_budget_does_not_fit_and_reports_largest_length() -> None:
    e = est(1, 131072, util=0.1)
    assert not e.fits
    assert 0 < e.largest_fitting_len < 131072
    assert est(1, e.largest_fitting_len, util=0.1).fits
    assert not est(1, e.largest_fitting_len + 16, util=0.1).fits


def test_reserve_is_within_the_references_1_to_2_gib() -> None:
    e = est(1, 4096)
    reserve = e.budget_bytes - e.weights_per_gpu - e.kv_pool_bytes
    assert 0.5 * GIB < reserve < 2 * GIB


def cpu(tp: int, mml: int, gib: int = 1):  # type: ignore[no-untyped-def]
    assert ERNIE is not None
    return estimate_cpu(ERNIE, kvcache_space_gib=gib, tp=tp, pp=1, max_model_len=mml)


def test_cpu_pool_of_1_gib_at_tp_1_is_the_58240_tokens_real_vllm_logged() -> None:
    # docs/vllm-facts.md#vllm-032-and-the-cpu-backend: measured on vLLM 0.32.0+cpu; 455 blocks of 128 tokens
    e = cpu(1, 4096)
    assert (e.kv_pool_bytes, e.kv_bytes_per_token, e.block_size) == (GIB, 18432, 128)
    assert e.kv_tokens == 58240 and e.cpu_kvcache_space == 1
    assert e.max_concurrency == pytest.approx(455 / 32)


def test_cpu_pool_is_per_worker_rank_so_tp_2_holds_twice_the_tokens() -> None:
    e = cpu(2, 4096)
    assert (e.kv_heads_per_gpu, e.kv_bytes_per_token, e.kv_tokens) == (1, 9216, 910 * 128)
    assert cpu(1, 4096, gib=2).kv_tokens == 910 * 128


def test_cpu_tokens_follow_vllms_formula_when_the_length_is_not_a_whole_block() -> None:
    # vLLM logs int(blocks / blocks per request × max_model_len): 455 / 16 × 2000, not 455 × 128
    assert cpu(1, 2000).kv_tokens == int(455 / 16 * 2000) == 56875


def test_cpu_fit_leaves_out_the_block_vllm_holds_back() -> None:
    e = cpu(1, 131072)
    assert not e.fits and e.one_sequence_bytes == int(2.25 * GIB)
    assert e.usable_bytes == GIB - 18432 * 128
    assert e.largest_fitting_len == 454 * 128
    assert cpu(1, 454 * 128).fits
    assert not cpu(1, 455 * 128).fits  # the whole pool, but vLLM keeps one block for itself
