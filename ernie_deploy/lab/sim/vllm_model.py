"""Model facts and memory arithmetic of the simulated vLLM, implemented from docs/vllm-facts.md
(#max-model-length to #memory-model).

Deliberately independent of the planner (ernie_deploy.*): if the two disagree, a lab test fails.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .vllm_versions import Profile

GIB = 1024**3
BLOCK_SIZE = 16

# Config keys vLLM reads for the context length (docs/vllm-facts.md#max-model-length); the smallest one wins.
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
ROPE_TYPES_WITHOUT_FACTOR = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
EXPERT_KEYS = ("moe_num_experts", "num_experts", "n_routed_experts", "num_local_experts")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}

# Our own memory constants (documented in README.md). They put ERNIE-4.5-0.3B at ~1.4 GiB of non-KV
# memory per GPU, inside the "roughly 1–2 GiB" estimate of docs/vllm-facts.md#memory-model, and ~8x
# concurrency on an A10.
NON_TORCH_BYTES = int(0.55 * GIB)  # CUDA context, cuBLAS workspaces
NCCL_BYTES = int(0.20 * GIB)  # extra non-torch memory per GPU when TP > 1
CUDAGRAPH_BYTES = int(0.25 * GIB)  # graph pools; 0.34 subtracts this estimate from the KV budget
ACTIVATION_BYTES_PER_HIDDEN = 48  # bytes per (batched token × hidden unit) at the profiling peak
LOGITS_BYTES = 4  # fp32 logits for one sampled token per sequence during profiling

# A small registry subset: what we model plus a few common architectures (docs/vllm-facts.md#vllm-model-registry).
_COMMON_ARCHS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
)


def registry(profile: Profile, has_ernie: bool) -> list[str]:
    archs = list(_COMMON_ARCHS[:2])
    if has_ernie:
        archs += [profile.ernie_dense_arch, "Ernie4_5_MoeForCausalLM"]
    return archs + list(_COMMON_ARCHS[2:])


class StartupError(Exception):
    """A start-up failure as vLLM would report it.

    `stage` says which process raises it ("api", "engine" or "worker") and `exc` is the exception line
    prefix: "ValueError", "pydantic:ModelConfig" (pydantic `Value error,` wrapping), "RuntimeError", …
    """

    def __init__(self, stage: str, exc: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.exc = exc
        self.message = message


@dataclass(frozen=True)
class ModelInfo:
    path: str
    config: dict[str, Any]
    architectures: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool
    torch_dtype: str
    num_experts: int


def load_model(path: str) -> ModelInfo:
    """Read MODEL/config.json; the simulator needs a local snapshot (no hub downloads in the lab)."""
    config = json.loads((Path(path) / "config.json").read_text())
    heads = int(config.get("num_attention_heads", 32))
    hidden = int(config.get("hidden_size", 4096))
    num_experts = next((int(config[k]) for k in EXPERT_KEYS if config.get(k)), 0)
    return ModelInfo(
        path=path,
        config=config,
        architectures=tuple(config.get("architectures", [])),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        layers=int(config.get("num_hidden_layers", 32)),
        hidden=hidden,
        intermediate=int(config.get("intermediate_size", 4 * hidden)),
        vocab=int(config.get("vocab_size", 32000)),
        tied=bool(config.get("tie_word_embeddings", False)),
        torch_dtype=str(config.get("torch_dtype", config.get("dtype", "bfloat16"))),
        num_experts=num_experts,
    )


@dataclass(frozen=True)
class DerivedLen:
    value: float | int  # printed as vLLM prints it (131072 or 131072.0)
    key: str | None
    model_max_length: int | None


def derive_max_len(model: ModelInfo, profile: Profile) -> DerivedLen:
    """vLLM's derived maximum length: smallest length key, model_max_length override, rope factor."""
    config = model.config
    value: float = math.inf
    key: str | None = None
    for candidate in LENGTH_KEYS:
        found = config.get(candidate)
        if isinstance(found, int | float) and found < value:
            value, key = found, candidate
    model_max_length = config.get("model_max_length")
    if isinstance(model_max_length, int | float):
        value = model_max_length
    if value == math.inf:
        return DerivedLen(2048, None, None)
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if "factor" in rope and rope_type not in ROPE_TYPES_WITHOUT_FACTOR:
        value = value * float(rope["factor"])
    shown: float | int = float(value) if profile.derived_len_float else value
    return DerivedLen(shown, key, model_max_length if isinstance(model_max_length, int) else None)


def param_count(model: ModelInfo) -> int:
    """Parameters of a Llama/ERNIE-style decoder (dense or ERNIE-MoE), from config.json alone."""
    c = model.config
    q = model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    attention = model.hidden * (q + 2 * kv) + q * model.hidden
    dense_mlp = 3 * model.hidden * model.intermediate
    per_layer_norms = 2 * model.hidden
    total = model.vocab * model.hidden * (1 if model.tied else 2) + model.hidden
    moe_inter = int(c.get("moe_intermediate_size", 0))
    start = int(c.get("moe_layer_start_index", 0))
    end = int(c.get("moe_layer_end_index", model.layers - 1))
    end = model.layers - 1 if end < 0 else end
    interval = max(1, int(c.get("moe_layer_interval", 1)))
    shared = int(c.get("moe_num_shared_experts", 0))
    for layer in range(model.layers):
        is_moe = model.num_experts and start <= layer <= end and (layer - start) % interval == 0
        if is_moe:
            mlp = (model.num_experts + shared) * 3 * model.hidden * moe_inter + model.hidden * model.num_experts
        else:
            mlp = dense_mlp
        total += attention + mlp + per_layer_norms
    return total


def dtype_bytes(dtype_flag: str, model: ModelInfo) -> int:
    name = model.torch_dtype if dtype_flag == "auto" else dtype_flag
    return DTYPE_BYTES.get(name.replace("torch.", ""), 2)


def torch_dtype_name(dtype_flag: str, model: ModelInfo) -> str:
    name = model.torch_dtype if dtype_flag == "auto" else dtype_flag
    return {"half": "float16", "float": "float32"}.get(name, name)


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    return 1 if kv_cache_dtype.startswith("fp8") else model_dtype_bytes


def kv_heads_per_rank(model: ModelInfo, tp: int) -> int:
    """KV heads are divided among TP ranks and replicated when there are fewer heads than ranks."""
    return max(1, model.kv_heads // tp)


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    requested: int
    weights: int
    activation: int
    non_torch: int
    cudagraph: int
    available_kv: int
    bytes_per_token: int
    num_blocks: int
    needed_for_max_len: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    def concurrency(self, max_model_len: int) -> float:
        return self.num_blocks / math.ceil(max_model_len / BLOCK_SIZE)

    def estimated_max_len(self) -> int:
        """Largest block-aligned length whose KV fits (vLLM binary-searches the same bound)."""
        return int(self.available_kv // (BLOCK_SIZE * self.bytes_per_token)) * BLOCK_SIZE


@dataclass(frozen=True)
class EngineSettings:
    tp: int
    gpu_util: float
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    dtype_bytes: int
    kv_dtype_bytes: int
    enforce_eager: bool


def plan_memory(model: ModelInfo, total_bytes: int, s: EngineSettings, profile: Profile) -> MemoryPlan:
    """requested = total × util; KV = requested − (weights/TP + activation peak + non-torch [+ graphs])."""
    requested = int(total_bytes * s.gpu_util)
    weights = int(param_count(model) * s.dtype_bytes / s.tp)
    mlp_width = model.intermediate // s.tp
    activation = s.max_num_batched_tokens * (model.hidden * ACTIVATION_BYTES_PER_HIDDEN + mlp_width * 4)
    activation += s.max_num_seqs * model.vocab * LOGITS_BYTES // s.tp
    non_torch = NON_TORCH_BYTES + (NCCL_BYTES if s.tp > 1 else 0)
    cudagraph = 0 if s.enforce_eager else CUDAGRAPH_BYTES
    available = requested - weights - activation - non_torch
    if profile.kv_subtracts_cudagraph:
        available -= cudagraph
    bytes_per_token = 2 * model.layers * kv_heads_per_rank(model, s.tp) * model.head_dim * s.kv_dtype_bytes
    page_per_layer = 2 * BLOCK_SIZE * kv_heads_per_rank(model, s.tp) * model.head_dim * s.kv_dtype_bytes
    num_blocks = max(0, int(available // page_per_layer // model.layers))
    needed = math.ceil(s.max_model_len / BLOCK_SIZE) * BLOCK_SIZE * bytes_per_token
    return MemoryPlan(
        total=total_bytes,
        requested=requested,
        weights=weights,
        activation=activation,
        non_torch=non_torch,
        cudagraph=cudagraph,
        available_kv=available,
        bytes_per_token=bytes_per_token,
        num_blocks=num_blocks,
        needed_for_max_len=needed,
    )


# ---------------------------------------------------------------------------------------------------
# Error texts, verbatim from docs/vllm-facts.md#start-up-errors where it quotes them.


def heads_error(model: ModelInfo, tp: int, profile: Profile) -> StartupError:
    return StartupError(
        "api",
        "pydantic:VllmConfig" if profile.heads_in_vllm_config else "ValueError",
        f"Total number of attention heads ({model.heads}) must be divisible by tensor parallel size ({tp}).",
    )


def max_len_exceeded(requested: int, derived: DerivedLen) -> str:
    """The first sentence of the error, also logged (with LONG_LEN_WARNING) when VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    return (
        f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
        f"({derived.key}={derived.value} or model_max_length={derived.model_max_length} in model's config.json)."
    )


def max_len_error(requested: int, derived: DerivedLen, profile: Profile) -> StartupError:
    msg = max_len_exceeded(requested, derived)
    if profile.max_len_old_wording:
        text = (
            f"{msg} This may lead to incorrect model outputs or CUDA errors. To allow overriding this "
            "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    else:
        allow = "To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        text = f"{msg} {allow} {LONG_LEN_WARNING}"
    return StartupError("api", "pydantic:ModelConfig", text)


LONG_LEN_WARNING = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
    "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
    "position encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."
)


def world_size_error(world_size: int, gpu_count: int, profile: Profile) -> StartupError:
    if profile.world_size_new_text:
        text = (
            f"World size ({world_size}) is larger than the number of available GPUs ({gpu_count}) in this "
            "node. If this is intentional and you are using:\n- ray, set '--distributed-executor-backend ray'."
            "\n- multiprocessing, set '--nnodes' appropriately."
        )
    else:
        text = ray_error()
    return StartupError("api", "pydantic:ParallelConfig", text)


def ray_error() -> str:
    return (
        "Unable to load Ray: No module named 'ray'. Ray is required for multi-node inference, "
        "please install Ray with `pip install ray`."
    )


def arch_error(model: ModelInfo, supported: list[str]) -> StartupError:
    text = (
        f"Model architectures {list(model.architectures)!r} are not supported for now. "
        f"Supported architectures: dict_keys({supported!r})"
    )
    return StartupError("api", "pydantic:ModelConfig", text)


def expert_parallel_error(profile: Profile) -> StartupError:
    return StartupError(
        "api",
        "pydantic:VllmConfig" if profile.heads_in_vllm_config else "ValueError",
        "Number of experts in the model must be greater than 0 when expert parallelism is enabled.",
    )


def moe_tp_error(tp: int, experts: int) -> StartupError:
    return StartupError(
        "worker", "ValueError", f"Tensor parallel size {tp} is greater than the number of experts {experts}."
    )


def _gib_round(value: float) -> float:
    return round(value / GIB, 2)


def format_gib(value: float) -> str:
    """vLLM's vllm/utils/mem_utils.py format_gib: `f"{round(b / GiB_bytes, 2)}"` (19.2, not 19.20)."""
    return f"{round(value / GIB, 2)}"


def free_memory_error(free: int, total: int, util: float, device: int, profile: Profile) -> StartupError:
    where = f"device cuda:{device}" if profile.free_mem_device_name else "device"
    text = (
        f"Free memory on {where} ({_gib_round(free)}/{_gib_round(total)} GiB) on startup is less than desired "
        f"GPU memory utilization ({util}, {_gib_round(total * util)} GiB). Decrease GPU memory utilization "
        "or reduce GPU memory used by other processes."
    )
    return StartupError("worker", "ValueError", text)


def no_kv_memory_error(profile: Profile) -> StartupError:
    text = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
            "engine")
    if profile.kv_hint_backend_note:  # 0.32.0 v1/core/kv_cache_utils.py:1009-1016
        text += (" (this flag also controls CPU memory reservation on the CPU backend, despite its name). See "
                 "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    else:
        text += "."
    return StartupError("engine", "ValueError", text)


def kv_too_small_error(plan: MemoryPlan, max_model_len: int, util: float, profile: Profile) -> StartupError:
    needed = plan.needed_for_max_len / GIB
    available = plan.available_kv / GIB
    estimated = plan.estimated_max_len()
    estimated_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimated}." if estimated > 0 else ""
    )
    if profile.kv_hint_backend_note:  # 0.32.0 v1/core/kv_cache_utils.py:1029-1039, format_gib amounts (captured)
        text = (
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({format_gib(plan.needed_for_max_len)} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({format_gib(plan.available_kv)} GiB). {estimated_msg + ' ' if estimated_msg else ''}"
            "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
            "decreasing `max_model_len` when initializing the engine. See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        )
    elif profile.kv_typo_models:
        text = (
            f"To serve at least one request with the models's max seq len ({max_model_len}), ({needed:.2f} GiB "
            f"KV cache is needed, which is larger than the available KV cache memory ({available:.2f} GiB). "
            f"{estimated_msg} Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            "initializing the engine."
        )
    else:
        # 0.34's `{hint}` text is not recorded in docs/vllm-facts.md#kv-cache-too-small; this hint is our
        # [UNVERIFIED] stand-in.
        hint = f" Try increasing `gpu_memory_utilization` (currently {util})."
        text = (
            f"To serve at least one request with the model's max seq len ({max_model_len}), ({needed:.2f} GiB "
            f"KV cache is needed, which is larger than the available KV cache memory ({available:.2f} GiB). "
            f"{estimated_msg}{hint} Decreasing `max_model_len` also reduces what is needed. See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        )
    return StartupError("engine", "ValueError", text)


def cuda_oom_error(total: int, util: float) -> StartupError:
    """PyTorch's allocator message (torch ≥2.4 wording), raised while profiling the dummy forward pass."""
    return _torch_oom(total, in_use=total * util, tried=2 * GIB)


def load_oom_error(total: int, loaded: int) -> StartupError:
    """The same allocator error while loading weights that do not fit the GPU (vLLM loads the weights before it
    profiles memory, so this comes before any KV-cache message)."""
    return _torch_oom(total, in_use=min(loaded, total - 64 * 1024 * 1024), tried=GIB // 2)


def _torch_oom(total: int, *, in_use: float, tried: int) -> StartupError:
    free = total - in_use
    text = (
        f"CUDA out of memory. Tried to allocate {tried / GIB:.2f} GiB. GPU 0 has a total capacity of "
        f"{total / GIB:.2f} GiB of which {free / GIB:.2f} GiB is free. Including non-PyTorch memory, this process "
        f"has {in_use / GIB:.2f} GiB memory in use. Of the allocated memory {in_use / GIB - 0.6:.2f} GiB is "
        "allocated by PyTorch, and 112.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    return StartupError("worker", "torch.OutOfMemoryError", text)


def nccl_error() -> StartupError:
    # vllm/distributed/device_communicators/pynccl_wrapper.py raises RuntimeError(f"NCCL error: {str}").
    return StartupError(
        "worker", "RuntimeError", "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)"
    )


def address_in_use_error() -> StartupError:
    return StartupError("api", "OSError", "[Errno 98] Address already in use")


def generic_traceback_error() -> StartupError:
    return StartupError("engine", "AttributeError", "'NoneType' object has no attribute 'shape'")
