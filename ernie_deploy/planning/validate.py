"""Checks that agree with real vLLM for the pinned version (texts from docs/vllm-facts.md#start-up-errors).

Each check is a pure function returning findings; `vllm_message` carries the exact text vLLM prints
where it would refuse to start.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import lru_cache

from ernie_deploy.planning.findings import Finding, Severity
from ernie_deploy.planning.hardware import GpuType
from ernie_deploy.planning.memory import GIB, MemoryEstimate, estimate, estimate_cpu
from ernie_deploy.planning.models import ModelSpec
from ernie_deploy.planning.plantypes import InstancePlan
from ernie_deploy.planning.versions import Presence, Version, version_facts

# Flags ernie-deploy writes itself from settings; in extra_args they would be duplicated or, for the
# API key, leak a secret onto the command line.
MANAGED_FLAGS = {
    "--tensor-parallel-size": "vllm_tensor_parallel_size", "-tp": "vllm_tensor_parallel_size",
    "--pipeline-parallel-size": "vllm_pipeline_parallel_size", "-pp": "vllm_pipeline_parallel_size",
    "--max-model-len": "vllm_max_model_len", "--port": "vllm_port", "--host": "vllm_host",
    "--gpu-memory-utilization": "vllm_gpu_memory_utilization", "--served-model-name": "vllm_served_model_name",
    "--api-key": "vllm_api_key (it goes into the 0600 environment file, never the command line)",
    "--model": "vllm_model",
}
V_0_20: Version = (0, 20, 0)
V_0_27_1: Version = (0, 27, 1)
V_0_33: Version = (0, 33, 0)


def _list(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in values)


def check_parallel(inst: InstancePlan, model: ModelSpec, gpu_count: int, version: Version) -> list[Finding]:
    out: list[Finding] = []
    tp, pp, name = inst.tensor_parallel_size, inst.pipeline_parallel_size, inst.unit
    if tp < 1 or pp < 1:
        return [Finding(Severity.ERROR, "parallel-size", f"tensor/pipeline parallel size must be ≥ 1 (got {tp}/{pp})",
                        fix="set vllm_tensor_parallel_size and vllm_pipeline_parallel_size to positive numbers",
                        instance=name)]
    gpus = len(inst.gpus)
    if model.num_attention_heads % tp:
        usable = model.valid_tp_sizes(limit=max(gpu_count // pp, 1))
        out.append(Finding(
            Severity.ERROR, "tp-heads",
            f"TP {tp} does not divide the model's {model.num_attention_heads} attention heads",
            vllm_message=(f"Total number of attention heads ({model.num_attention_heads}) must be divisible by "
                          f"tensor parallel size ({tp})."),
            fix=(f"set vllm_tensor_parallel_size to {usable[-1]} (valid on this {gpu_count}-GPU host: {_list(usable)}; "
                 f"valid for the model: {_list(model.valid_tp_sizes())})"),
            instance=name))
    world = tp * pp
    if world > gpus:
        if version >= V_0_20:
            text = (f"World size ({world}) is larger than the number of available GPUs ({gpus}) in this node. "
                    "If this is intentional and you are using:\n- ray, set '--distributed-executor-backend ray'.\n"
                    "- multiprocessing, set '--nnodes' appropriately.")
        else:
            text = ("Unable to load Ray: ... Ray is required for multi-node inference, please install Ray with "
                    "`pip install ray`.")
        fitting = [t for t in model.valid_tp_sizes(limit=gpus // pp or 1)]
        out.append(Finding(
            Severity.ERROR, "world-size",
            f"TP {tp} × PP {pp} = {world} GPUs, but this instance has {gpus}",
            vllm_message=text,
            fix=f"set vllm_tensor_parallel_size to {fitting[-1]} or fewer instances per host", instance=name))
    if model.is_moe and tp > model.num_experts:
        out.append(Finding(
            Severity.ERROR, "moe-tp-experts", f"TP {tp} exceeds the model's {model.num_experts} experts",
            vllm_message=f"Tensor parallel size {tp} is greater than the number of experts {model.num_experts}.",
            fix=f"set vllm_tensor_parallel_size ≤ {model.num_experts}", instance=name))
    if "--enable-expert-parallel" in inst.args and not model.is_moe:
        out.append(Finding(
            Severity.ERROR, "ep-dense", f"expert parallelism on {model.name}, a dense model with no experts",
            vllm_message="Number of experts in the model must be greater than 0 when expert parallelism is enabled.",
            fix="remove --enable-expert-parallel from vllm_extra_args", instance=name))
    return out


def check_context(inst: InstancePlan, model: ModelSpec, version: Version) -> list[Finding]:
    mml = inst.max_model_len
    if mml is None:
        return []
    if mml < 1:
        return [Finding(Severity.ERROR, "max-model-len", f"max_model_len must be ≥ 1 (got {mml})",
                        fix="set vllm_max_model_len to a positive number", instance=inst.unit)]
    if mml <= model.derived_max_len:
        return []
    # vLLM 0.33 printed the derived length as a float (observed "131072.0"); earlier sources show ints.
    derived = f"{float(model.derived_max_len)}" if version >= V_0_33 else str(model.derived_max_len)
    return [Finding(
        Severity.ERROR, "max-model-len",
        f"max_model_len {mml} is above the model's derived maximum {model.derived_max_len} ({model.max_len_key})",
        vllm_message=(f"User-specified max_model_len ({mml}) is greater than the derived max_model_len "
                      f"({model.max_len_key}={derived} or model_max_length={model.model_max_length} "
                      "in model's config.json)."),
        fix=f"set vllm_max_model_len to {model.derived_max_len} or less", instance=inst.unit)]


def _weights_fix(inst: InstancePlan, model: ModelSpec, gpu: GpuType, gpu_count: int) -> str:
    """The smallest TP whose weights and KV cache fit this GPU (and how many GPUs it takes), or the GPU memory
    the model needs at this host's GPU count."""
    mml, util, pp = inst.max_model_len, inst.gpu_memory_utilization, inst.pipeline_parallel_size
    for tp in range(inst.tensor_parallel_size + 1, 65):
        if model.num_attention_heads % tp:
            continue
        m = memory_for(tp, pp, mml, util, model, gpu)
        if m is not None and m.fits:
            gpus = tp * pp
            where = "this host has them" if gpus <= gpu_count else f"this host has {gpu_count}"
            return (f"set vllm_tensor_parallel_size to {tp}, the smallest that fits: {gpus} × {gpu.name} per "
                    f"instance ({where})")
    tp = max(t for t in range(1, gpu_count + 1) if model.num_attention_heads % t == 0)
    at = memory_for(tp, pp, mml, util, model, gpu)
    if at is None:
        return "use GPUs with more memory"
    need = (at.weights_per_gpu + at.activation_bytes + at.runtime_bytes + at.one_sequence_bytes) / util
    return f"at this host's {gpu_count} GPU(s) (TP {tp}) each GPU needs about {need / GIB:.0f} GiB: use larger GPUs"


def check_memory(inst: InstancePlan, model: ModelSpec, gpu: GpuType, version: Version,
                 gpu_count: int = 1) -> list[Finding]:
    m = inst.memory
    if m is None:
        return []
    u = inst.gpu_memory_utilization  # in (0, 1]: settings.SETTING_TYPES bounds it wherever it is set
    if m.cpu_kvcache_space is not None:
        return _check_cpu_memory(inst, m, model)
    if m.weights_per_gpu > m.gpu_total_bytes:
        # vLLM loads the weights before it profiles memory: weights larger than the GPU fail right there, with
        # PyTorch's allocator error, long before "No available memory for the cache blocks".
        return [Finding(
            Severity.ERROR, "weights-exceed-gpu",
            f"the weights need {m.weights_per_gpu / GIB:.2f} GiB per GPU at TP {inst.tensor_parallel_size}; "
            f"one {gpu.name} has {m.gpu_total_bytes / GIB:.2f} GiB",
            vllm_message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
            fix=_weights_fix(inst, model, gpu, gpu_count), instance=inst.unit)]
    if m.kv_pool_bytes <= 0:
        return [Finding(
            Severity.ERROR, "kv-no-memory",
            f"weights ({m.weights_per_gpu / GIB:.2f} GiB/GPU) and reserves leave no KV cache memory "
            f"in {u} × {gpu.memory_mib} MiB",
            vllm_message=("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                          "when initializing the engine."),
            fix="raise vllm_gpu_memory_utilization or vllm_tensor_parallel_size", instance=inst.unit)]
    if not m.fits:
        owner = "model's" if version >= V_0_27_1 else "models's"
        return [Finding(
            Severity.ERROR, "kv-too-small",
            f"one {m.max_model_len}-token sequence needs {m.one_sequence_bytes / GIB:.2f} GiB of KV cache per GPU; "
            f"about {m.kv_pool_bytes / GIB:.2f} GiB are available",
            vllm_message=(f"To serve at least one request with the {owner} max seq len ({m.max_model_len}), "
                          f"({m.one_sequence_bytes / GIB:.2f} GiB KV cache is needed, which is larger than the "
                          f"available KV cache memory ({m.kv_pool_bytes / GIB:.2f} GiB)."),
            fix=(f"set vllm_max_model_len to {m.largest_fitting_len} or less (the largest that fits), or raise "
                 "vllm_gpu_memory_utilization / vllm_tensor_parallel_size"),
            instance=inst.unit)]
    limit = "the model's own limit" if m.largest_fitting_len >= model.derived_max_len else "what the KV pool holds"
    return [Finding(
        Severity.INFO, "kv-headroom",
        f"KV cache: one {m.max_model_len}-token sequence needs {m.one_sequence_bytes / GIB:.2f} GiB per GPU of "
        f"{m.kv_pool_bytes / GIB:.2f} GiB available ({m.kv_tokens:,} tokens, maximum concurrency "
        f"{m.max_concurrency:.2f}x); the largest max_model_len that fits is {m.largest_fitting_len} ({limit})",
        instance=inst.unit)]


def _gib(size: int) -> str:
    """A size as vLLM 0.32 prints it in KV messages (`format_gib`, 2 places: vllm/utils/mem_utils.py:30-31)."""
    return f"{round(size / GIB, 2)}"


def _check_cpu_memory(inst: InstancePlan, m: MemoryEstimate, model: ModelSpec) -> list[Finding]:
    """The KV checks of an instance on vLLM's CPU backend, whose pool is vllm_cpu_kvcache_space GiB per worker rank
    (memory.estimate_cpu); texts from vLLM 0.32.0 vllm/v1/core/kv_cache_utils.py:1003-1040."""
    space = m.cpu_kvcache_space
    # The smallest whole GiB that holds one full-length sequence plus the block vLLM holds back.
    need_gib = -(-(m.one_sequence_bytes + m.held_back_bytes) // GIB)
    if m.usable_bytes <= 0:
        return [Finding(
            Severity.ERROR, "kv-no-memory",
            f"vllm_cpu_kvcache_space {space} GiB holds no KV cache block beyond the one vLLM keeps "
            f"({m.held_back_bytes / GIB:.2f} GiB per block of {m.block_size} tokens)",
            vllm_message="No available memory for the cache blocks.",
            fix=f"set vllm_cpu_kvcache_space to {need_gib} or more", instance=inst.unit)]
    if not m.fits:
        return [Finding(
            Severity.ERROR, "kv-too-small",
            f"one {m.max_model_len}-token sequence needs {m.one_sequence_bytes / GIB:.2f} GiB of KV cache per worker "
            f"rank; vllm_cpu_kvcache_space gives {space} GiB, {m.usable_bytes / GIB:.2f} GiB of it usable",
            vllm_message=(f"To serve at least one request with the model's max seq len ({m.max_model_len}), "
                          f"({_gib(m.one_sequence_bytes)} GiB KV cache is needed, which is larger than the available "
                          f"KV cache memory ({_gib(m.usable_bytes)} GiB)."),
            fix=(f"set vllm_max_model_len to {m.largest_fitting_len} or less (the largest that fits), or "
                 f"vllm_cpu_kvcache_space to {need_gib}"),
            instance=inst.unit)]
    limit = "the model's own limit" if m.largest_fitting_len >= model.derived_max_len else "what the KV pool holds"
    return [Finding(
        Severity.INFO, "kv-headroom",
        f"KV cache from vllm_cpu_kvcache_space ({space} GiB per worker rank, vLLM's CPU backend): one "
        f"{m.max_model_len}-token sequence needs {m.one_sequence_bytes / GIB:.2f} GiB ({m.kv_tokens:,} tokens, "
        f"maximum concurrency {m.max_concurrency:.2f}x); the largest max_model_len that fits is "
        f"{m.largest_fitting_len} ({limit})",
        instance=inst.unit)]


def check_sharing(instances: Sequence[InstancePlan], gpu: GpuType, version: Version) -> list[Finding]:
    """Instances on the same GPU each take utilization × total, so the fractions must sum to ≤ 1."""
    users: dict[int, list[InstancePlan]] = defaultdict(list)
    for inst in instances:
        for g in inst.gpus:
            users[g].append(inst)
    # One finding per group of instances, naming every GPU they overcommit.
    overcommitted: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for g, group in sorted(users.items()):
        if len(group) > 1 and sum(i.gpu_memory_utilization for i in group) > 1.0 + 1e-9:
            overcommitted[tuple(i.index for i in group)].append(g)
    out = []
    for members, gpus in overcommitted.items():
        group = [instances[i] for i in members]
        last, total = group[-1], sum(i.gpu_memory_utilization for i in group)
        free = gpu.memory_bytes * max(0.0, 1 - sum(i.gpu_memory_utilization for i in group[:-1]))
        device = "" if version < V_0_33 else f"cuda:{gpus[0]} "
        out.append(Finding(
            Severity.ERROR, "gpu-shared-overcommit",
            f"GPU(s) {_list(gpus)} are shared by {', '.join(i.unit for i in group)} whose memory fractions sum "
            f"to {total:.2f}",
            vllm_message=(f"Free memory on device {device}({free / GIB:.2f}/{gpu.memory_bytes / GIB:.2f} GiB) "
                          "on startup is less than desired GPU memory utilization "
                          f"({last.gpu_memory_utilization}, "
                          f"{gpu.memory_bytes * last.gpu_memory_utilization / GIB:.2f} GiB). Decrease GPU "
                          "memory utilization or reduce GPU memory used by other processes."),
            fix=f"set vllm_gpu_memory_utilization to {1 / len(group):.2f} or less on each instance",
            instance=last.unit))
    return out


def check_versioned(inst: InstancePlan, model: ModelSpec, version: Version, version_text: str) -> list[Finding]:
    facts = version_facts()
    out: list[Finding] = []
    arch = facts.architectures.get(model.architecture)
    if arch is not None:
        presence = arch.presence(version)
        if presence is Presence.ABSENT:
            known = sorted(a for a, o in facts.architectures.items() if o.presence(version) is Presence.PRESENT)
            out.append(Finding(
                Severity.ERROR, "architecture",
                f"vLLM {version_text} does not know the architecture {model.architecture} ({arch.note})",
                vllm_message=(f"Model architectures ['{model.architecture}'] are not supported for now. "
                              "Supported architectures: ..."),
                fix=_arch_fix(model.architecture, known, arch.note),
                instance=inst.unit))
        elif presence is Presence.UNKNOWN:
            out.append(Finding(
                Severity.WARNING, "architecture-unknown",
                f"not known whether vLLM {version_text} registers {model.architecture} ({arch.note})",
                fix="check `Resolved architecture:` in the start-up log after deploying", instance=inst.unit))
    for arg in inst.args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            out.append(Finding(Severity.ERROR, "managed-flag", f"{flag} in vllm_extra_args",
                               fix=f"remove it and set {MANAGED_FLAGS[flag]}", instance=inst.unit))
            continue
        info = facts.flags.get(flag)
        if info is None:
            continue
        presence = info.presence(version)
        if presence is Presence.ABSENT:
            out.append(Finding(Severity.ERROR, "removed-flag", f"{flag} does not exist in vLLM {version_text}",
                               vllm_message=f"vllm serve: error: unrecognized arguments: {flag}",
                               fix=info.note, instance=inst.unit))
        elif presence is Presence.UNKNOWN:
            out.append(Finding(Severity.WARNING, "flag-unknown",
                               f"{flag} was removed between vLLM releases; not known for {version_text}",
                               fix=info.note, instance=inst.unit))
    return out


def _arch_fix(arch: str, known: list[str], note: str) -> str:
    renamed = [k for k in known if k.replace("_", "") == arch.replace("_", "")]
    if renamed:
        return (f"set \"architectures\": [\"{renamed[0]}\"] in the model's config.json (the current hub name), "
                "or pin a vLLM version that knows the old name with vllm_version")
    return f"pin a vLLM version that supports it ({note or 'see the vLLM model registry'})"


def check_topology(instances: Sequence[InstancePlan], model: ModelSpec, gpu: GpuType, gpu_count: int) -> list[Finding]:
    """Advice, not errors: layouts that start fine but waste the GPUs. Every instance of a host has the same
    layout, so each piece of advice is given once per host, in numbers for the GPUs its instances use."""
    if not instances:
        return []
    inst = instances[0]
    out = []
    tp = inst.tensor_parallel_size
    used = len(instances) * tp * inst.pipeline_parallel_size  # GPUs the host's instances take now
    if tp > 2 and not gpu.nvlink:
        pairs = used // 2
        out.append(Finding(
            Severity.ADVICE, "tp-pcie",
            f"TP {tp} on PCIe-only {gpu.name} GPUs: vLLM turns custom all-reduce off and all-reduces over PCIe",
            vllm_message=("Custom allreduce is disabled because it's not supported on more than two PCIe-only "
                          "GPUs. To silence this warning, specify disable_custom_all_reduce=True explicitly."),
            fix=f"use {pairs} replicas of TP 2 on the same {used} GPUs (vllm_instances: {pairs}, "
                "vllm_tensor_parallel_size: 2)"))
    if tp > 1 and inst.max_model_len is not None:
        single = estimate(model, gpu_name=gpu.name, gpu_total_bytes=gpu.memory_bytes,
                          utilization=inst.gpu_memory_utilization, tp=1, pp=1, max_model_len=inst.max_model_len)
        if single.fits:
            out.append(Finding(
                Severity.ADVICE, "tp-small-model",
                f"{model.name} fits one {gpu.name} at max_model_len {inst.max_model_len} "
                f"({single.weights_per_gpu / GIB:.2f} GiB of weights, maximum concurrency "
                f"{single.max_concurrency:.2f}x on one GPU); with TP {tp} the GPUs spend time talking to each other",
                fix=f"run {used} replicas of TP 1 on the same {used} GPUs instead (vllm_instances: {used}, "
                    "vllm_tensor_parallel_size: 1)"))
    return out


def check_instance(inst: InstancePlan, model: ModelSpec, gpu: GpuType, gpu_count: int, version: Version,
                   version_text: str) -> list[Finding]:
    findings = check_parallel(inst, model, gpu_count, version) + check_context(inst, model, version)
    findings += check_versioned(inst, model, version, version_text)
    if not findings or all(f.severity is not Severity.ERROR for f in findings):
        findings += check_memory(inst, model, gpu, version, gpu_count)
    return findings


@lru_cache(maxsize=1024)  # a fleet repeats a handful of layouts; the estimate is pure
def memory_for(inst_tp: int, inst_pp: int, mml: int | None, util: float, model: ModelSpec,
               gpu: GpuType, cpu_kvcache_space: int | None = None) -> MemoryEstimate | None:
    """The instance's KV estimate: from vllm_cpu_kvcache_space when it is set (vLLM's CPU backend then takes
    that pool as given), else from the GPU memory model."""
    if inst_tp < 1 or inst_pp < 1 or not 0 < util <= 1:
        return None
    if cpu_kvcache_space is not None:
        if cpu_kvcache_space < 1:
            return None  # an error of its own (cpubackend.check_kvcache_space); no pool to estimate
        return estimate_cpu(model, kvcache_space_gib=cpu_kvcache_space, tp=inst_tp, pp=inst_pp,
                            max_model_len=mml if mml and mml > 0 else model.derived_max_len)
    return estimate(model, gpu_name=gpu.name, gpu_total_bytes=gpu.memory_bytes, utilization=util, tp=inst_tp,
                    pp=inst_pp, max_model_len=mml if mml and mml > 0 else model.derived_max_len)
