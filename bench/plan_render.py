"""Benchmark: load, plan and render a generated inventory of N hosts (no SSH, no hosts needed).

    python bench/plan_render.py            # 1k, 10k and 100k hosts
    python bench/plan_render.py 10000      # one size

Prints seconds per phase and per-host cost, so linear growth shows as a flat µs/host column.
The hosts cycle through the guide's four hardware rows, in groups of 100 with group vars, the way a
real fleet inventory is laid out.
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.render import environment_for_templates, render_hosts, templates_dir

ROWS = [("NVIDIA A10", 1), ("NVIDIA A10", 2), ("NVIDIA A10", 4), ("NVIDIA A100-SXM4-80GB", 2)]


def write_inventory(n: int, directory: Path) -> Path:
    children = {}
    for g in range(0, n, 100):
        model, count = ROWS[(g // 100) % len(ROWS)]
        hosts = {f"gpu-{i:06d}.dc{i % 3}": {"ansible_host": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"}
                 for i in range(g, min(g + 100, n))}
        children[f"rack{g // 100:05d}"] = {"vars": {"gpu_model": model, "gpu_count": count}, "hosts": hosts}
    path = directory / f"fleet-{n}.yml"
    path.write_text(yaml.safe_dump({"all": {"vars": {"ansible_user": "deploy"}, "children": children}},
                                   sort_keys=False))
    return path


def run(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_inventory(n, Path(tmp))
        t0 = time.perf_counter()
        inventory = load_inventory(path)
        t1 = time.perf_counter()
        plans = plan_hosts(list(inventory.select(None)), PlanContext.load())
        t2 = time.perf_counter()
        env = environment_for_templates(templates_dir())
        rendered, failed = render_hosts(plans, env)
        t3 = time.perf_counter()
    assert len(plans) == n and all(p.ok for p in plans) and not failed
    assert sum(len(files) for files in rendered.values()) == 2 * n
    return {"load": t1 - t0, "plan": t2 - t1, "render": t3 - t2, "total": t3 - t0}


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1_000, 10_000, 100_000]
    print(f"# {platform.node()} · {platform.processor() or platform.machine()} · Python {platform.python_version()}")
    print(f"{'hosts':>8} {'load s':>8} {'plan s':>8} {'render s':>9} {'total s':>8} {'µs/host':>8}")
    for n in sizes:
        r = run(n)
        print(f"{n:>8} {r['load']:>8.2f} {r['plan']:>8.2f} {r['render']:>9.2f} {r['total']:>8.2f} "
              f"{r['total'] / n * 1e6:>8.0f}")


if __name__ == "__main__":
    main()
