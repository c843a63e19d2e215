"""GPU balance and ownership for one instance, from two nvidia-smi queries (docs/nvidia-smi.md#csv-queries).

Commands the caller runs (CSV, no header, no units; fields separated by ", "):
  nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits
  nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits
CUDA_VISIBLE_DEVICES indices equal nvidia-smi indices here: the units never set CUDA_DEVICE_ORDER, and
the planner assigns GPUs by nvidia-smi index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ernie_deploy.checks.result import CheckInputError, CheckResult

GPU_QUERY = "index,uuid,memory.used,memory.total,utilization.gpu"
APPS_QUERY = "pid,used_memory,gpu_uuid"


@dataclass(frozen=True)
class GpuRow:
    index: int
    uuid: str
    memory_used_mib: float
    memory_total_mib: float
    utilization_gpu: float | None  # None where the driver prints [N/A] (MIG, some vGPUs)


@dataclass(frozen=True)
class ComputeApp:
    pid: int
    used_memory_mib: float | None  # None where the driver cannot attribute memory ([N/A])
    gpu_uuid: str


def csv_rows(text: str, n: int, what: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of `nvidia-smi --query-*=... --format=csv,noheader,nounits` output: the one reader
    of nvidia-smi's CSV (facts, verify and the GPU checks all use it)."""
    rows: list[tuple[int, list[str]]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("No running"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if lineno == 1 and parts[0] in ("index", "pid"):
            continue  # a header line: the caller forgot noheader; harmless
        if len(parts) != n:
            raise CheckInputError(f"{what} line {lineno}: expected {n} fields, got {len(parts)}: {line!r}",
                                  hint=f"run it with --format=csv,noheader,nounits and the fields in {__name__}")
        rows.append((lineno, parts))
    return rows


def csv_number(value: str, what: str, lineno: int, field: str) -> float | None:
    text = value.removesuffix("MiB").removesuffix("%").strip()  # tolerate output without nounits
    if text in ("[N/A]", "N/A", "[Not Supported]"):
        return None
    try:
        return float(text)
    except ValueError:
        raise CheckInputError(f"{what} line {lineno}: {field} is not a number: {value!r}") from None


def parse_gpu_rows(text: str) -> list[GpuRow]:
    """Rows of `nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu`."""
    what = "nvidia-smi --query-gpu"
    rows = []
    for lineno, (index, uuid, used, total, util) in csv_rows(text, 5, what):
        if not index.isdigit():
            raise CheckInputError(f"{what} line {lineno}: index is not a number: {index!r}")
        mem_used = csv_number(used, what, lineno, "memory.used")
        mem_total = csv_number(total, what, lineno, "memory.total")
        if mem_used is None or mem_total is None:
            raise CheckInputError(f"{what} line {lineno}: memory is [N/A]; cannot judge balance")
        rows.append(GpuRow(int(index), uuid, mem_used, mem_total, csv_number(util, what, lineno, "utilization.gpu")))
    return rows


def parse_compute_apps(text: str) -> list[ComputeApp]:
    """Rows of `nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid` (empty output: no processes)."""
    what = "nvidia-smi --query-compute-apps"
    apps = []
    for lineno, (pid, used, uuid) in csv_rows(text, 3, what):
        if not pid.isdigit():
            raise CheckInputError(f"{what} line {lineno}: pid is not a number: {pid!r}")
        apps.append(ComputeApp(int(pid), csv_number(used, what, lineno, "used_memory"), uuid))
    return apps


def _fmt(values: dict[int, float], unit: str) -> str:
    return ", ".join(f"GPU {i}: {v:.0f}{unit}" for i, v in sorted(values.items()))


def check_gpus(
    gpu_rows: str | Sequence[GpuRow],
    apps_rows: str | Sequence[ComputeApp],
    *,
    instance_gpus: tuple[int, ...],
    instance_pids: set[int],
    mem_spread_mib: float = 512,
    util_spread: float = 5,
    idle_mib: float = 1024,
    instance: str | None = None,
) -> list[CheckResult]:
    """Balance, ownership and use of the GPUs of one instance (the guide: memory within 0.5 GiB, util ±5).

    `instance_pids` is the unit's whole process tree (API server, EngineCore, workers): with TP>1 the
    workers, not the API server, own the GPU memory. `idle_mib` separates "vLLM holds its KV cache here"
    from an idle GPU (a CUDA context alone is ~500 MiB).
    """
    gpus = parse_gpu_rows(gpu_rows) if isinstance(gpu_rows, str) else list(gpu_rows)
    apps = parse_compute_apps(apps_rows) if isinstance(apps_rows, str) else list(apps_rows)
    by_index = {g.index: g for g in gpus}
    missing = [i for i in instance_gpus if i not in by_index]
    if missing:
        return [CheckResult("gpus_present", "fail", f"GPU(s) {missing} of the instance are not in nvidia-smi "
                            f"(it lists {sorted(by_index)})", tuple(f"{g.index}, {g.uuid}" for g in gpus),
                            cause="the plan's CUDA_VISIBLE_DEVICES names GPUs this host does not have",
                            fix="check gpu_count in the inventory against `nvidia-smi -L`", instance=instance)]
    mine = [by_index[i] for i in instance_gpus]
    uuids = {g.uuid: g.index for g in mine}
    return [
        _memory_balance(mine, mem_spread_mib, instance),
        _util_balance(mine, util_spread, instance),
        _foreign(apps, uuids, instance_pids, instance),
        _in_use(mine, apps, instance_pids, idle_mib, instance),
    ]


def _memory_balance(mine: list[GpuRow], limit: float, instance: str | None) -> CheckResult:
    used = {g.index: g.memory_used_mib for g in mine}
    spread = max(used.values()) - min(used.values())
    text = _fmt(used, " MiB")
    if spread > limit:
        return CheckResult("gpu_memory_balance", "fail", f"memory.used differs by {spread:.0f} MiB across the "
                           f"instance's GPUs (limit {limit:.0f} MiB): {text}", (text,),
                           cause="tensor-parallel ranks hold equal shares, so an uneven GPU carries something else "
                                 "(another process, a leftover EngineCore) or a rank failed to allocate its KV cache",
                           fix="compare with `nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv`",
                           instance=instance)
    return CheckResult("gpu_memory_balance", "pass", f"memory.used within {spread:.0f} MiB (limit {limit:.0f}): {text}",
                       (text,), instance=instance)


def _util_balance(mine: list[GpuRow], limit: float, instance: str | None) -> CheckResult:
    util = {g.index: g.utilization_gpu for g in mine if g.utilization_gpu is not None}
    if len(util) < len(mine):
        return CheckResult("gpu_utilization_balance", "warn", "utilization.gpu is [N/A] on some GPUs (MIG/vGPU)",
                           instance=instance)
    spread = max(util.values()) - min(util.values())
    text = _fmt(util, "%")
    if spread > limit:
        return CheckResult("gpu_utilization_balance", "fail", f"utilization differs by {spread:.0f} points "
                           f"(limit {limit:.0f}): {text}", (text,),
                           cause="TP ranks run in lockstep, so one busier GPU is doing work for someone else",
                           fix="sample again under load; if it persists, look for foreign processes on the busy GPU",
                           instance=instance)
    return CheckResult("gpu_utilization_balance", "pass", f"utilization within {spread:.0f} points (limit "
                       f"{limit:.0f}): {text}", (text,), instance=instance)


def _foreign(apps: list[ComputeApp], uuids: dict[str, int], pids: set[int], instance: str | None) -> CheckResult:
    on_mine = [a for a in apps if a.gpu_uuid in uuids]
    if not pids:
        return CheckResult("gpu_foreign_processes", "warn", "no process tree given for the instance; cannot tell "
                           "its processes from others",
                           tuple(f"pid {a.pid} on GPU {uuids[a.gpu_uuid]}" for a in on_mine), instance=instance)
    foreign = [a for a in on_mine if a.pid not in pids]
    if foreign:
        lines = tuple(f"pid {a.pid} uses {a.used_memory_mib if a.used_memory_mib is not None else '?'} MiB on GPU "
                      f"{uuids[a.gpu_uuid]} ({a.gpu_uuid})" for a in foreign)
        return CheckResult("gpu_foreign_processes", "fail", f"{len(foreign)} process(es) outside the instance run on "
                           f"its GPUs: {', '.join(str(a.pid) for a in foreign)}", lines,
                           cause="another program shares the GPU: it competes for memory and compute",
                           fix="identify it with `ps -o pid,user,cmd -p PID` and stop it or move the instance",
                           instance=instance)
    return CheckResult("gpu_foreign_processes", "pass",
                       f"only the instance's processes on GPUs {sorted(uuids.values())}",
                       tuple(f"pid {a.pid} on GPU {uuids[a.gpu_uuid]}" for a in on_mine), instance=instance)


def _in_use(mine: list[GpuRow], apps: list[ComputeApp], pids: set[int], idle_mib: float,
            instance: str | None) -> CheckResult:
    idle = []
    for g in mine:
        on_gpu = [a for a in apps if a.gpu_uuid == g.uuid]
        if any(a.pid in pids for a in on_gpu):
            continue
        # Inside containers nvidia-smi often lists no processes at all; then memory is the only witness.
        if not on_gpu and g.memory_used_mib >= idle_mib:
            continue
        idle.append(g)
    if idle:
        lines = tuple(f"GPU {g.index} ({g.uuid}): {g.memory_used_mib:.0f} MiB used, no process of the instance"
                      for g in idle)
        return CheckResult("gpus_in_use", "fail", f"GPU(s) {[g.index for g in idle]} of the instance are idle", lines,
                           cause="a tensor-parallel rank is missing, or CUDA_VISIBLE_DEVICES differs from the plan",
                           fix="check the unit's Environment=CUDA_VISIBLE_DEVICES and the Worker_TP lines in "
                               "its journal",
                           instance=instance)
    return CheckResult("gpus_in_use", "pass", f"all {len(mine)} GPU(s) of the instance hold its memory",
                       instance=instance)
