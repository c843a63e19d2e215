"""The GPU map of a host's plan: which instance holds which GPU, and how each GPU's memory splits between the
weights (W), the KV-cache pool (K), vLLM's runtime reserve (R: activations, CUDA graphs, NCCL) and what stays
free (.), as one bar of fixed width per GPU. Idle GPUs show as all free (and are the `idle-gpus` finding)."""

from __future__ import annotations

from ernie_deploy.planning.memory import GIB
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan

BAR = 24  # characters per GPU: one is about 4 % of its memory


def gpu_map_lines(plan: HostPlan) -> list[str]:
    """The map's lines; none where there is nothing to draw (no GPU model, vLLM's CPU backend, no estimate)."""
    if plan.gpu is None or not plan.instances or any(i.memory is None or i.cpu_kvcache_space is not None
                                                     for i in plan.instances):
        return []
    total = plan.instances[0].memory.gpu_total_bytes if plan.instances[0].memory else 0
    if total <= 0:
        return []
    holders: dict[int, list[InstancePlan]] = {g: [] for g in range(plan.gpu_count)}
    for inst in plan.instances:
        for g in inst.gpus:
            holders.setdefault(g, []).append(inst)
    width = max(len(" + ".join(i.unit for i in held) or "idle") for held in holders.values())
    lines = [f"GPU map ({plan.gpu.name}, {total / GIB:.2f} GiB each; W weights, K KV cache, R runtime reserve, "
             ". free):"]
    for gpu, held in sorted(holders.items()):
        parts = [_share(i) for i in held]
        used = [n for share in parts for n in share]
        free = total - sum(used)
        bar = "".join(mark * _cells(n, total) for share in parts for mark, n in zip("WKR", share, strict=True))
        bar = (bar + "." * BAR)[:BAR]
        amounts = "  ".join(f"{mark} {n / GIB:.2f}" for mark, n in zip("WKR", [sum(s[k] for s in parts)
                                                                                for k in range(3)], strict=True))
        names = " + ".join(i.unit for i in held) or "idle"
        lines.append(f"  GPU {gpu}  {names:<{width}}  [{bar}]  " + (f"{amounts}  free {free / GIB:.2f} GiB"
                                                                    if held else f"free {free / GIB:.2f} GiB"))
    return lines


def _share(inst: InstancePlan) -> tuple[int, int, int]:
    """An instance's bytes on each of its GPUs: weights, KV pool, runtime reserve (activations included)."""
    m = inst.memory
    if m is None:
        return (0, 0, 0)
    return (m.weights_per_gpu, max(m.kv_pool_bytes, 0), m.activation_bytes + m.runtime_bytes)


def _cells(part: int, total: int) -> int:
    return max(1, round(part * BAR / total)) if part > 0 else 0
