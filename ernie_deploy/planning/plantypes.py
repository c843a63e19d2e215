"""The values a plan is made of: one HostPlan per host, one InstancePlan per vLLM service on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ernie_deploy.planning.findings import Finding, Severity
from ernie_deploy.planning.hardware import GpuType
from ernie_deploy.planning.memory import MemoryEstimate
from ernie_deploy.planning.models import ModelSpec
from ernie_deploy.planning.settings import Secret, Setting


@dataclass(frozen=True)
class Discovered:
    """What the host itself says (from facts), which replaces what the inventory declares."""

    gpu_name: str | None
    gpu_count: int
    gpu_memory_mib: int | None
    nvlink: bool | None
    gpu_error: str | None = None
    model_config: dict[str, Any] | None = None
    model_error: str | None = None
    model_readable: bool | None = None  # can vllm_user read config.json (None: not known)
    vllm_version: str | None = None
    vllm_error: str | None = None


@dataclass(frozen=True)
class InstancePlan:
    index: int
    unit: str  # systemd unit name without ".service"
    port: int
    host: str  # --host bind address
    gpus: tuple[int, ...]  # CUDA_VISIBLE_DEVICES
    served_model_name: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int | None  # None: vLLM derives it from the model config
    gpu_memory_utilization: float
    args: tuple[str, ...]  # profile flags + extra_args, in that order
    memory: MemoryEstimate | None
    # vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE (GiB per worker rank) and VLLM_CPU_OMP_THREADS_BIND of this
    # instance; None leaves the variable unset.
    cpu_kvcache_space: int | None = None
    cpu_omp_threads_bind: str | None = None

    @property
    def name(self) -> str:
        return self.unit


@dataclass(frozen=True)
class Tuning:
    """The settings the rollout, its checks and the exports act on, typed; `HostPlan.settings` keeps where each
    came from, for explain."""

    startup_budget: float  # seconds a (re)started instance may take to become ready
    stable_seconds: float  # seconds an instance must stay healthy (or up) to count as ready (or serving)
    keep_releases: int  # releases kept on the host for rollback
    share_gpus: bool
    extra_args: tuple[str, ...]  # vllm_extra_args: the end of every instance's args, after the profile's flags


@dataclass(frozen=True)
class HostPlan:
    name: str
    address: str
    gpu: GpuType | None
    gpu_count: int
    row: str | None
    profile: str | None
    model: ModelSpec | None
    model_path: str
    version: str
    bin: str
    user: str
    drain_timeout: int
    env: dict[str, str]
    secrets: dict[str, Secret]
    settings: dict[str, Setting]
    tuning: Tuning
    instances: tuple[InstancePlan, ...]
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    # Findings the host's ernie_ignore silenced (never errors): shown with -v, counted nowhere.
    silenced: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.name,
            "address": self.address,
            "gpu": {"model": self.gpu.name if self.gpu else None, "count": self.gpu_count,
                    "memory_mib": self.gpu.memory_mib if self.gpu else None,
                    "nvlink": self.gpu.nvlink if self.gpu else None},
            "row": self.row,
            "profile": self.profile,
            "model": {"path": self.model_path, "architecture": self.model.architecture if self.model else None,
                      "derived_max_len": self.model.derived_max_len if self.model else None},
            "vllm_version": self.version,
            "ok": self.ok,
            "settings": {k: {"value": v.value if not isinstance(v.value, Secret) else "[REDACTED]",
                             "source": v.source, **({"where": v.where} if v.where else {})}
                         for k, v in self.settings.items()},
            "instances": [instance_json(i) for i in self.instances],
            "findings": [f.to_json() for f in self.findings],
            "silenced": [f.to_json() for f in self.silenced],
        }


def instance_json(i: InstancePlan) -> dict[str, Any]:
    m = i.memory
    return {
        "unit": f"{i.unit}.service",
        "port": i.port,
        "gpus": list(i.gpus),
        "served_model_name": i.served_model_name,
        "tensor_parallel_size": i.tensor_parallel_size,
        "pipeline_parallel_size": i.pipeline_parallel_size,
        "max_model_len": i.max_model_len,
        "gpu_memory_utilization": i.gpu_memory_utilization,
        "args": list(i.args),
        "cpu_kvcache_space_gib": i.cpu_kvcache_space,
        "cpu_omp_threads_bind": i.cpu_omp_threads_bind,
        "memory": None if m is None else {
            # Where the KV pool comes from: vLLM's CPU backend takes vllm_cpu_kvcache_space as given; on GPUs it
            # is what gpu_memory_utilization leaves after weights and reserves.
            "kv_pool_source": "gpu_memory_utilization" if m.cpu_kvcache_space is None else "vllm_cpu_kvcache_space",
            "kv_block_size": m.block_size,
            "weights_per_gpu_bytes": m.weights_per_gpu,
            "activation_reserve_bytes": m.activation_bytes,
            "runtime_reserve_bytes": m.runtime_bytes,
            "kv_pool_bytes": m.kv_pool_bytes,
            "kv_heads_per_gpu": m.kv_heads_per_gpu,
            "kv_head_replicas": m.kv_head_replicas,
            "kv_bytes_per_token_per_gpu": m.kv_bytes_per_token,
            "kv_tokens": m.kv_tokens,
            "max_concurrency": round(m.max_concurrency, 2),
            "largest_fitting_max_model_len": m.largest_fitting_len,
        },
    }
