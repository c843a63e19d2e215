"""Are an instance's GPUs free again after its stop? Pure judgement of one nvidia-smi reading.

A new vLLM process checks free memory against --gpu-memory-utilization at start-up and fails when the old
one has not let go yet (vllm #55510; LMCache PR #4851 waits on every TP GPU against the pre-vLLM baseline;
the driver frees memory asynchronously, unsloth PR #5693). So before a start, every GPU of the instance
must show no compute process and used memory back near the baseline recorded when the instance started.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ernie_deploy.checks.gpus import ComputeApp, GpuRow

# "Near the baseline": a CUDA context of a monitoring tool or the driver's own bookkeeping moves used memory
# by some MiB; a vLLM instance holds GiBs. The guide's balance tolerance is 0.5 GB as well.
MARGIN_MIB = 512.0


@dataclass(frozen=True)
class Holder:
    pid: int
    gpu: int
    name: str  # process name (ps comm), "" when unknown
    used_mib: float | None


@dataclass(frozen=True)
class Release:
    free: bool
    holders: tuple[Holder, ...] = ()
    high: tuple[tuple[int, float, float], ...] = ()  # (gpu, used MiB, allowed MiB) still above the baseline

    def describe(self) -> str:
        parts = [f"GPU {h.gpu} held by PID {h.pid}" + (f" ({h.name})" if h.name else "") for h in self.holders]
        parts += [f"GPU {g} uses {used:.0f} MiB (baseline + margin {allowed:.0f} MiB)"
                  for g, used, allowed in self.high]
        return "; ".join(parts) or "free"


def judge(gpus: Sequence[int], rows: Sequence[GpuRow], apps: Sequence[ComputeApp], names: Mapping[int, str],
          baseline: Mapping[int, float], sharing: Collection[int] = ()) -> Release:
    """Free when no compute process other than `sharing` (processes of other running instances that share these
    GPUs) runs on any of `gpus`, and each GPU with a recorded baseline is back within the margin of it, not
    counting what `sharing` holds (a GPU without one, from an instance started before baselines were kept, is
    judged by its processes only)."""
    by_uuid = {r.uuid: r.index for r in rows}
    wanted = set(gpus)
    holders = tuple(Holder(a.pid, by_uuid[a.gpu_uuid], names.get(a.pid, ""), a.used_memory_mib)
                    for a in apps if by_uuid.get(a.gpu_uuid) in wanted and a.pid not in sharing)
    shared = {g: sum(a.used_memory_mib or 0.0 for a in apps if a.pid in sharing and by_uuid.get(a.gpu_uuid) == g)
              for g in wanted}
    high = tuple((r.index, r.memory_used_mib - shared[r.index], baseline[r.index] + MARGIN_MIB) for r in rows
                 if r.index in wanted and r.index in baseline
                 and r.memory_used_mib - shared[r.index] > baseline[r.index] + MARGIN_MIB)
    return Release(not holders and not high, holders, high)
