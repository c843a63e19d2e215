"""Model facts from a Hugging Face config.json, derived the way vLLM derives them.

Sources: docs/vllm-facts.md#ernie-models (ERNIE configs, parameter count) and docs/vllm-facts.md#max-model-length
(max length rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.datafiles import bundled, load_json

# vLLM checks these keys and takes the smallest value it finds (0.34.0 derive_max_model_len_and_key).
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
# Rope types whose factor vLLM does NOT multiply into the derived length.
ROPE_TYPES_WITHOUT_SCALING = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
# Without any length key vLLM assumes 2048 and warns.
FALLBACK_MAX_LEN = 2048
EXPERT_KEYS = ("moe_num_experts", "num_experts", "n_routed_experts", "num_local_experts")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
DEFAULT_MODEL = "ERNIE-4.5-0.3B-PT"


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model."""

    name: str
    source: str
    architecture: str
    model_type: str
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_experts: int
    derived_max_len: int
    max_len_key: str
    model_max_length: int | None
    dtype: str
    param_count: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2)

    @property
    def weight_bytes(self) -> int:
        return self.param_count * self.dtype_bytes

    def valid_tp_sizes(self, limit: int | None = None) -> list[int]:
        """TP sizes vLLM accepts for this model: divisors of the attention heads (and ≤ experts for MoE)."""
        top = self.num_attention_heads if limit is None else min(limit, self.num_attention_heads)
        sizes = [tp for tp in range(1, top + 1) if self.num_attention_heads % tp == 0]
        if self.is_moe:
            sizes = [tp for tp in sizes if tp <= self.num_experts]
        return sizes


def _int(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        if value is None:
            raise ConfigError(f"config.json has no {key!r}", where=where, hint="point at a complete config.json")
        raise ConfigError(f"{key}: expected an integer, got {value!r}", where=where)
    return int(value)


def derive_max_len(config: dict[str, Any]) -> tuple[int, str, int | None]:
    """vLLM's derived max_model_len: (length, the key it came from, model_max_length)."""
    found = {k: config[k] for k in LENGTH_KEYS if isinstance(config.get(k), int | float)}
    model_max_length = config.get("model_max_length")
    if not found:
        return FALLBACK_MAX_LEN, "default", None
    key = min(found, key=lambda k: found[k])
    length = found[key]
    if isinstance(model_max_length, int | float):
        key, length = "model_max_length", model_max_length
    rope = config.get("rope_scaling")
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if rope_type not in ROPE_TYPES_WITHOUT_SCALING and isinstance(factor, int | float):
            length *= factor
    return int(length), key, int(model_max_length) if isinstance(model_max_length, int | float) else None


def count_parameters(c: dict[str, Any], where: str) -> int:
    """Parameter count of a Llama-style decoder (ERNIE-4.5 dense and MoE), see docs/vllm-facts.md#dense-model."""
    hidden = _int(c, "hidden_size", where)
    vocab = _int(c, "vocab_size", where)
    layers = _int(c, "num_hidden_layers", where)
    heads = _int(c, "num_attention_heads", where)
    kv_heads = _int(c, "num_key_value_heads", where, heads)
    head_dim = _int(c, "head_dim", where, hidden // heads)
    inter = _int(c, "intermediate_size", where)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    dense_mlp = 3 * hidden * inter
    experts = num_experts(c)
    moe_inter = int(c.get("moe_intermediate_size") or inter)
    shared = int(c.get("moe_num_shared_experts") or c.get("n_shared_experts") or 0)
    moe_mlp = 3 * hidden * moe_inter * (experts + shared) + hidden * experts
    start = int(c.get("moe_layer_start_index", 0) or 0)
    end = c.get("moe_layer_end_index", -1)
    end = layers - 1 if end in (None, -1) else int(end)
    interval = int(c.get("moe_layer_interval", 1) or 1)
    total = vocab * hidden + hidden  # embedding + final norm
    if not c.get("tie_word_embeddings", False):
        total += vocab * hidden
    for layer in range(layers):
        is_moe = experts > 0 and start <= layer <= end and (layer - start) % interval == 0
        total += attention + 2 * hidden + (moe_mlp if is_moe else dense_mlp)
    return total


def num_experts(config: dict[str, Any]) -> int:
    for key in EXPERT_KEYS:
        value = config.get(key)
        if isinstance(value, list):  # some configs list experts per modality; vLLM uses the first
            value = value[0] if value else 0
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def spec_from_config(config: dict[str, Any], name: str, source: str) -> ModelSpec:
    where = source
    if not isinstance(config, dict):
        raise ConfigError("config.json must be a JSON object", where=where)
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError("config.json has no 'architectures' list", where=where,
                          hint="vLLM needs the architecture name to pick its model class")
    heads = _int(config, "num_attention_heads", where)
    hidden = _int(config, "hidden_size", where)
    length, key, model_max_length = derive_max_len(config)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelSpec(
        name=name,
        source=source,
        architecture=archs[0],
        model_type=str(config.get("model_type", "")),
        num_attention_heads=heads,
        num_kv_heads=_int(config, "num_key_value_heads", where, heads),
        head_dim=_int(config, "head_dim", where, hidden // heads),
        num_layers=_int(config, "num_hidden_layers", where),
        hidden_size=hidden,
        intermediate_size=_int(config, "intermediate_size", where),
        vocab_size=_int(config, "vocab_size", where),
        num_experts=num_experts(config),
        derived_max_len=length,
        max_len_key=key,
        model_max_length=model_max_length,
        dtype=dtype,
        param_count=count_parameters(config, where),
    )


def load_model(path: str | Path, name: str | None = None) -> ModelSpec:
    """ModelSpec from a config.json file or a model directory holding one."""
    p = Path(path)
    config_path = p / "config.json" if p.is_dir() else p
    if not config_path.is_file():
        raise ConfigError(f"no config.json at {config_path}", where=str(path),
                          hint="set vllm_model_config to a model directory or its config.json")
    label = name or (p.name if p.is_dir() else p.parent.name)
    return spec_from_config(load_json(config_path), label, str(config_path))


def bundled_model(name: str) -> ModelSpec | None:
    """The shipped config of a known model, matched by the last part of its path or hub id."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    path = bundled(f"models/{base}/config.json")
    return load_model(path, base) if path.is_file() else None


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf  # type: ignore[return-value]
