"""vLLM's CPU backend: the settings vllm_cpu_kvcache_space and vllm_cpu_omp_threads_bind, which become
VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND in each instance's unit (docs/variables.md#vllms-cpu-backend).

What vLLM does with them, from the vLLM 0.32.0 source (docs/vllm-facts.md#vllm-032-and-the-cpu-backend):

* VLLM_CPU_OMP_THREADS_BIND is `auto` (the default: worker rank k binds to NUMA node k), `nobind`, or one CPU list
  per worker rank joined by `|` (vllm/utils/ompmultiprocessing.py:122-185). A CPU list is parsed like `0-2,4`
  (vllm/utils/cpu_resource_utils.py:174-186). The number of lists must equal the local world size, TP × PP
  (ompmultiprocessing.py:163-167; vllm/config/parallel.py:835-836, :945-949).
* Both are read only on vLLM's CPU platform, which vLLM picks when its version contains `cpu` (e.g. 0.32.0+cpu)
  or VLLM_TARGET_DEVICE is `cpu` (vllm/platforms/__init__.py:18-30, :174-190).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ernie_deploy.planning.findings import Finding, Severity
from ernie_deploy.planning.plantypes import InstancePlan

KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# One rank's CPU list as vLLM parses it: ids and ascending ranges, comma-separated. vLLM's int() would also take
# spaces around the numbers; the documented form has none, and a unit file is clearer without them.
_CPU_LIST = re.compile(r"[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*")
_KEYWORDS = ("auto", "nobind")
_FORMAT = "auto, nobind, or one CPU list per worker rank joined by '|' (CPU ids and ranges like 0-3,8)"


def instance_binds(value: str | list[str] | None, count: int) -> list[str | None]:
    """Each instance's VLLM_CPU_OMP_THREADS_BIND: one string for all of them, or a list in instance order
    (an instance past the list's end gets none; `check_bind_count` reports the mismatch)."""
    if value is None or isinstance(value, str):
        return [value] * count
    return [value[k] if k < len(value) else None for k in range(count)]


def _cpus(group: str) -> list[int]:
    out: list[int] = []
    for part in group.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def _problem(value: str) -> str | None:
    """Why `value` is not a VLLM_CPU_OMP_THREADS_BIND value, or None."""
    if value in _KEYWORDS:
        return None
    for group in value.split("|"):
        if not group:
            return "an empty CPU list (two '|' in a row, or one at either end) gives a rank no CPUs"
        if not _CPU_LIST.fullmatch(group):
            return f"{group!r} is not a CPU list like 0-3,8"
        for part in group.split(","):
            first, _, last = part.partition("-")
            if last and int(last) < int(first):
                return f"the range {part} runs backwards, so vLLM would give its rank no CPUs from it"
    return None


def _compact(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def suggest_bind(world: int, value: str | None = None) -> str:
    """A value with one CPU list per rank: the CPUs `value` names split evenly into `world` lists when there are
    enough of them, else CPUs 0 … world−1 (one each)."""
    cpus: list[int] = []
    if value is not None and value not in _KEYWORDS and _problem(value) is None:
        cpus = list(dict.fromkeys(c for group in value.split("|") for c in _cpus(group)))
    if len(cpus) < world:
        return "|".join(str(k) for k in range(world))
    size, extra = divmod(len(cpus), world)
    lists, start = [], 0
    for k in range(world):
        end = start + size + (1 if k < extra else 0)
        lists.append(_compact(cpus[start:end]))
        start = end
    return "|".join(lists)


def check_bind(inst: InstancePlan) -> list[Finding]:
    """The instance's VLLM_CPU_OMP_THREADS_BIND against its worker ranks."""
    value = inst.cpu_omp_threads_bind
    world = inst.tensor_parallel_size * inst.pipeline_parallel_size
    ranks = f"TP {inst.tensor_parallel_size} × PP {inst.pipeline_parallel_size} = {world} worker rank(s)"
    if value is None:
        if inst.cpu_kvcache_space is None or world < 2:
            return []
        return [Finding(
            Severity.WARNING, "cpu-omp-bind-auto",
            f"{ranks} with {BIND_ENV} unset: vLLM's default `auto` binds rank k to NUMA node k and stops on a "
            f"host with fewer than {world} NUMA nodes",
            vllm_message=f"Not enough allowed NUMA nodes to bind threads of {world} local CPUWorkers.",
            fix=f"set vllm_cpu_omp_threads_bind to one CPU list per rank, e.g. {suggest_bind(world)!r}, or to "
                f"'auto' if the host has {world} NUMA nodes", instance=inst.unit)]
    problem = _problem(value)
    if problem is not None:
        return [Finding(
            Severity.ERROR, "cpu-omp-bind",
            f"vllm_cpu_omp_threads_bind {value!r} is not a {BIND_ENV} value: {problem}",
            fix=f"write {_FORMAT}, e.g. {suggest_bind(world)!r} for {ranks}", instance=inst.unit)]
    if value in _KEYWORDS:
        return []
    groups = value.split("|")
    if len(groups) == world:
        return []
    return [Finding(
        Severity.ERROR, "cpu-omp-bind-ranks",
        f"vllm_cpu_omp_threads_bind {value!r} gives {len(groups)} CPU list(s), but {ranks} need one each",
        vllm_message=f"Given number of CPU id list {groups} doesn't match local world size {world}.",
        fix=f"set vllm_cpu_omp_threads_bind to {suggest_bind(world, value)!r} (one CPU list per rank, joined by '|'), "
            "or to nobind", instance=inst.unit)]


def check_bind_count(value: str | list[str] | None, instances: Sequence[InstancePlan]) -> list[Finding]:
    if not isinstance(value, list) or len(value) == len(instances):
        return []
    return [Finding(
        Severity.ERROR, "cpu-omp-bind-count",
        f"vllm_cpu_omp_threads_bind lists {len(value)} value(s) for {len(instances)} instance(s)",
        fix=f"give one value per instance in instance order ({', '.join(i.unit for i in instances)}), or one "
            "string for all of them")]


def check_bind_overlap(instances: Sequence[InstancePlan]) -> list[Finding]:
    """Advice: two instances whose OpenMP threads are bound to the same CPUs slow each other down."""
    owned: dict[int, str] = {}
    for inst in instances:
        value = inst.cpu_omp_threads_bind
        if value is None or value in _KEYWORDS or _problem(value) is not None:
            continue
        mine = {c for group in value.split("|") for c in _cpus(group)}
        for cpu in sorted(mine):
            other = owned.get(cpu)
            if other is not None and other != inst.unit:
                shared = sorted(c for c in mine if owned.get(c) == other)
                return [Finding(
                    Severity.ADVICE, "cpu-omp-bind-overlap",
                    f"{other} and {inst.unit} bind their OpenMP threads to the same CPUs ({_compact(shared)})",
                    fix="give each instance its own CPUs: a list for vllm_cpu_omp_threads_bind, one value per "
                        "instance", instance=inst.unit)]
        for cpu in mine:
            owned.setdefault(cpu, inst.unit)
    return []


def check_kvcache_space(value: int | None) -> list[Finding]:
    if value is None or value >= 1:
        return []
    # vLLM takes 0 GiB as given and then has nothing for the cache (vllm/v1/worker/cpu_worker.py:213-228,
    # vllm/v1/core/kv_cache_utils.py:1009-1017).
    return [Finding(
        Severity.ERROR, "cpu-kvcache-space",
        f"vllm_cpu_kvcache_space must be at least 1 (GiB of KV cache per worker rank), got {value}",
        vllm_message="No available memory for the cache blocks.",
        fix="set vllm_cpu_kvcache_space to the whole GiB of KV cache each worker rank gets, e.g. 1")]


def check_build(version_text: str, env: Mapping[str, str], used: Sequence[str]) -> list[Finding]:
    """The CPU variables do nothing on a vLLM that does not run its CPU platform, and the KV estimate would be
    the CPU backend's all the same."""
    if not used or "cpu" in version_text or env.get("VLLM_TARGET_DEVICE") == "cpu":
        return []
    names = " and ".join(f"vllm_{n}" for n in used)
    return [Finding(
        Severity.WARNING, "cpu-settings-gpu-build",
        f"{names} set, but vLLM {version_text} is not a CPU build: vLLM reads {KVCACHE_ENV} and {BIND_ENV} only on "
        "its CPU platform, which it picks when its version contains 'cpu' (e.g. 0.32.0+cpu)",
        fix=f"pin the version of the CPU build the host runs (it contains 'cpu', e.g. vllm_version: \"0.32.0+cpu\"), "
            f"or remove {names} from hosts that run vLLM on GPUs")]


def cpu_findings(instances: Sequence[InstancePlan], space: int | None, bind: str | list[str] | None,
                 version_text: str, env: Mapping[str, str]) -> list[Finding]:
    used = [n for n, v in (("cpu_kvcache_space", space), ("cpu_omp_threads_bind", bind)) if v is not None]
    findings = check_kvcache_space(space) + check_bind_count(bind, instances)
    for inst in instances:
        if not (isinstance(bind, list) and inst.cpu_omp_threads_bind is None):  # else check_bind_count's error
            findings += check_bind(inst)
    return findings + check_bind_overlap(instances) + check_build(version_text, env, used)
