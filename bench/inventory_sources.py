"""Benchmark: what reading an inventory costs per command, by source kind and reader (no hosts needed).

    python bench/inventory_sources.py            # 10 and 1000 hosts, 5 runs each
    python bench/inventory_sources.py 100 9      # one size, 9 runs

Times whole `ernie-deploy plan --json` commands (the CLI's start-up included) on the same fleet written as a
YAML file (the bundled reader), the same YAML through ansible-inventory (ERNIE_INVENTORY_READER=ansible), an INI
file (always through ansible-inventory), and `ansible-inventory --list` alone on the INI file. Prints the median
seconds and the ratio to the bundled reader, so the cost of the ansible-inventory process shows directly.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROWS = [("NVIDIA A10", 1), ("NVIDIA A10", 2), ("NVIDIA A10", 4), ("NVIDIA A100-SXM4-80GB", 2)]


def write_fleet(n: int, directory: Path) -> tuple[Path, Path]:
    """The fleet as a YAML and an INI inventory: racks of up to 100 hosts, each rack one hardware row."""
    children: dict[str, dict[str, object]] = {}
    ini: list[str] = []
    for g in range(0, n, 100):
        model, count = ROWS[(g // 100) % len(ROWS)]
        rack = f"rack{g // 100:05d}"
        hosts = {f"gpu-{i:06d}": {"ansible_host": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"}
                 for i in range(g, min(g + 100, n))}
        children[rack] = {"vars": {"gpu_model": model, "gpu_count": count}, "hosts": hosts}
        ini += [f"[{rack}]", *(f"{h} ansible_host={v['ansible_host']}" for h, v in hosts.items()),
                f"[{rack}:vars]", f"gpu_model={model!r}", f"gpu_count={count}", ""]
    yaml_path, ini_path = directory / f"fleet-{n}.yml", directory / f"fleet-{n}.ini"
    yaml_path.write_text(yaml.safe_dump({"all": {"vars": {"ansible_user": "deploy"}, "children": children}},
                                        sort_keys=False))
    ini_path.write_text("\n".join(ini) + "\n[all:vars]\nansible_user=deploy\n")
    return yaml_path, ini_path


def median_seconds(argv: list[str], env: dict[str, str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        times.append(time.perf_counter() - start)
        if done.returncode not in (0, 1):  # 1: a plan with errors still read the whole inventory
            sys.exit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.decode()[-400:]}")
    return statistics.median(times)


def main() -> None:
    sizes = [int(sys.argv[1])] if len(sys.argv) > 1 else [10, 1000]
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    tool = Path(sys.executable).parent / "ansible-inventory"
    if not tool.exists():
        sys.exit("ansible-inventory is not installed beside this Python (pip install ansible-core)")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
          f", median of {runs} runs")
    print(f"{'hosts':>6}  {'YAML, bundled':>14}  {'YAML, ansible':>14}  {'INI, ansible':>13}  "
          f"{'ansible-inventory alone':>24}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("ERNIE_")}
    plan = [sys.executable, "-m", "ernie_deploy", "plan", "--json", "-i"]
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            yaml_path, ini_path = write_fleet(n, Path(tmp))
            bundled = median_seconds([*plan, str(yaml_path)], base, runs)
            through = median_seconds([*plan, str(yaml_path)], {**base, "ERNIE_INVENTORY_READER": "ansible"}, runs)
            ini = median_seconds([*plan, str(ini_path)], base, runs)
            alone = median_seconds([str(tool), "-i", str(ini_path), "--list"], base, runs)
            print(f"{n:>6}  {bundled:>12.2f} s  {through:>7.2f} s ×{through / bundled:<4.1f}  "
                  f"{ini:>6.2f} s ×{ini / bundled:<4.1f}  {alone:>22.2f} s")


if __name__ == "__main__":
    main()
