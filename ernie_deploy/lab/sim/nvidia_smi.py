"""Simulated `nvidia-smi` for the rehearsal lab.

Reads the host's GPUs from ``$ERNIE_LAB_ROOT/etc/ernie-lab/gpus.json`` and live usage registered by
simulated vLLM processes under ``$ERNIE_LAB_ROOT/run/ernie-lab/gpu/``. Output formats follow
docs/nvidia-smi.md and the nvidia-smi man page.

Supported: no arguments (summary table), ``-L``, ``--query-gpu=…``, ``--query-compute-apps=…``,
``--format=csv[,noheader][,nounits]``, ``-i/--id``, ``topo -m``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import cached_property
from typing import NamedTuple

from .simstate import (
    Gpu,
    HostGpus,
    UsageEntry,
    load_host_gpus,
    read_entries,
    used_mib_by_gpu,
    utilization_by_gpu,
)

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
# Exit codes documented in nvidia-smi(1): 2 invalid argument, 6 not found, 9 driver not loaded.
EXIT_INVALID_ARG = 2
EXIT_NOT_FOUND = 6
EXIT_NO_DRIVER = 9

# Board power limits (product briefs): A10 150 W, A100 SXM4 400 W, A100 PCIe 40GB 250 W / 80GB 300 W.
_POWER_LIMIT_W = (
    ("A100-SXM4", 400.0), ("A100-PCIE", 250.0), ("A100 80GB PCIe", 300.0), ("A10G", 300.0), ("A10", 150.0),
)


class Usage:
    """What runs on the GPUs, read once per invocation and only when asked: the registry and, for real vLLM
    workers, every process in /proc (real_entries), which a query of static fields (the facts' index, name,
    uuid, memory.total, driver_version) never needs."""

    @cached_property
    def entries(self) -> list[UsageEntry]:
        return read_entries()

    @cached_property
    def used_mib(self) -> dict[str, int]:
        return used_mib_by_gpu(self.entries)

    @cached_property
    def util(self) -> dict[str, int]:
        return utilization_by_gpu(self.entries)


class GpuView:
    """One GPU with its current simulated usage."""

    __slots__ = ("count", "gpu", "host", "usage")

    def __init__(self, gpu: Gpu, usage: Usage, count: int, host: HostGpus) -> None:
        self.gpu, self.usage, self.count, self.host = gpu, usage, count, host

    @property
    def used_mib(self) -> int:
        return self.usage.used_mib.get(self.gpu.uuid, 0)

    @property
    def util(self) -> int:
        return self.usage.util.get(self.gpu.uuid, 0)

    @property
    def free_mib(self) -> int:
        return max(0, self.gpu.memory_total_mib - self.used_mib)

    @property
    def power_limit(self) -> float:
        for key, watts in _POWER_LIMIT_W:
            if key in self.gpu.name:
                return watts
        return 300.0

    @property
    def power_draw(self) -> float:
        # Idle draw ~10% of the limit, rising with utilization; a memory-holding idle GPU sits in P0.
        return round(self.power_limit * (0.1 + 0.75 * self.util / 100) + (5.0 if self.used_mib else 0.0), 2)

    @property
    def temperature(self) -> int:
        return 30 + self.util * 4 // 10

    @property
    def compute_cap(self) -> str:
        return "8.6" if "A10" in self.gpu.name else "8.0"


class Field(NamedTuple):
    header: str  # header text including the unit suffix, e.g. "memory.total [MiB]"
    unit: str  # appended to values unless nounits, e.g. " MiB"
    value: Callable[[GpuView], str]


GPU_FIELDS: dict[str, Field] = {
    "timestamp": Field("timestamp", "", lambda v: time.strftime("%Y/%m/%d %H:%M:%S.000")),
    "driver_version": Field("driver_version", "", lambda v: v.host.driver_version),
    "count": Field("count", "", lambda v: str(v.count)),
    "index": Field("index", "", lambda v: str(v.gpu.index)),
    "name": Field("name", "", lambda v: v.gpu.name),
    "uuid": Field("uuid", "", lambda v: v.gpu.uuid),
    "pci.bus_id": Field("pci.bus_id", "", lambda v: v.gpu.pci_bus_id),
    "memory.total": Field("memory.total [MiB]", " MiB", lambda v: str(v.gpu.memory_total_mib)),
    "memory.used": Field("memory.used [MiB]", " MiB", lambda v: str(v.used_mib)),
    "memory.free": Field("memory.free [MiB]", " MiB", lambda v: str(v.free_mib)),
    "utilization.gpu": Field("utilization.gpu [%]", " %", lambda v: str(v.util)),
    "utilization.memory": Field("utilization.memory [%]", " %", lambda v: str(v.util // 2)),
    "temperature.gpu": Field("temperature.gpu", "", lambda v: str(v.temperature)),
    "power.draw": Field("power.draw [W]", " W", lambda v: f"{v.power_draw:.2f}"),
    "power.limit": Field("power.limit [W]", " W", lambda v: f"{v.power_limit:.2f}"),
    "compute_cap": Field("compute_cap", "", lambda v: v.compute_cap),
    "pstate": Field("pstate", "", lambda v: "P0" if v.used_mib else "P8"),
    "persistence_mode": Field("persistence_mode", "", lambda v: "Enabled"),
}
# Aliases listed by `nvidia-smi --help-query-gpu` ("name" or "gpu_name", …); the header echoes the
# name as requested. [UNVERIFIED] whether real nvidia-smi echoes the alias or the canonical name.
GPU_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id"}

# `--query-compute-apps`: the header for `used_memory` is `used_gpu_memory [MiB]` (from memory of real
# output and third-party parsers; not in docs/nvidia-smi.md, so [UNVERIFIED] but widely relied on).
APP_FIELDS: dict[str, tuple[str, str]] = {
    "pid": ("pid", ""),
    "process_name": ("process_name", ""),
    "gpu_name": ("gpu_name", ""),
    "gpu_uuid": ("gpu_uuid", ""),
    "gpu_bus_id": ("gpu_bus_id", ""),
    "used_memory": ("used_gpu_memory [MiB]", " MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", " MiB"),
}


class SmiError(Exception):
    """An nvidia-smi failure: the text goes to stdout (as nvidia-smi does) with an exit code."""

    def __init__(self, text: str, code: int) -> None:
        super().__init__(text)
        self.text = text
        self.code = code


def _invalid_field(name: str) -> SmiError:
    # Real output (CoHDI/composable-resource-operator#37): stdout 'Field "x" is not a valid field to
    # query.\n\n', stderr empty, exit code 2.
    return SmiError(f'Field "{name}" is not a valid field to query.\n\n', EXIT_INVALID_ARG)


class Options:
    def __init__(self) -> None:
        self.query_gpu: list[str] | None = None
        self.query_apps: list[str] | None = None
        self.fmt: set[str] | None = None
        self.ids: list[str] | None = None
        self.list_gpus = False
        self.topo = False


def _take_value(args: list[str], i: int, flag: str) -> tuple[str, int]:
    """Value of `--flag=value` or `--flag value` / `-i value`; returns (value, next index)."""
    arg = args[i]
    if "=" in arg:
        return arg.split("=", 1)[1], i + 1
    if i + 1 >= len(args):
        raise SmiError(f"Option {flag} requires a value.\n\nPlease run 'nvidia-smi -h' for help.\n", 2)
    return args[i + 1], i + 2


def parse_args(args: list[str]) -> Options:
    opts = Options()
    if args[:1] == ["topo"]:
        if "-m" not in args[1:] and "--matrix" not in args[1:]:
            raise SmiError("Invalid combination of input arguments. Please run 'nvidia-smi topo -h' for help.\n", 2)
        opts.topo = True
        return opts
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in ("-L", "--list-gpus"):
            opts.list_gpus, i = True, i + 1
        elif name == "--query-gpu":
            value, i = _take_value(args, i, name)
            opts.query_gpu = [f.strip() for f in value.split(",") if f.strip()]
        elif name == "--query-compute-apps":
            value, i = _take_value(args, i, name)
            opts.query_apps = [f.strip() for f in value.split(",") if f.strip()]
        elif name == "--format":
            value, i = _take_value(args, i, name)
            opts.fmt = {f.strip() for f in value.split(",")}
        elif name in ("-i", "--id"):
            value, i = _take_value(args, i, name)
            opts.ids = [x.strip() for x in value.split(",") if x.strip()]
        else:
            raise SmiError("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n", 2)
    if (opts.query_gpu or opts.query_apps) and opts.fmt is None:
        raise SmiError("--format must be specified with --query-gpu or --query-compute-apps.\n", 2)
    if opts.fmt is not None and "csv" not in opts.fmt:
        raise SmiError("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n", 2)
    return opts


def gpu_views(host: HostGpus, ids: list[str] | None, usage: Usage) -> list[GpuView]:
    gpus = list(host.gpus)
    if ids is not None:
        wanted = [g for g in gpus if str(g.index) in ids or g.uuid in ids or g.pci_bus_id in ids]
        if len(wanted) != len(ids):
            raise SmiError("No devices were found\n", EXIT_NOT_FOUND)
        gpus = wanted
    count = len(host.gpus)
    return [GpuView(g, usage, count, host) for g in gpus]


def query_gpu(views: list[GpuView], fields: list[str], fmt: set[str]) -> str:
    resolved: list[Field] = []
    for name in fields:
        canonical = GPU_ALIASES.get(name, name)
        if canonical not in GPU_FIELDS:
            raise _invalid_field(name)
        base = GPU_FIELDS[canonical]
        header = base.header.replace(canonical, name, 1)
        resolved.append(Field(header, base.unit, base.value))
    units = "nounits" not in fmt
    lines = [] if "noheader" in fmt else [", ".join(f.header for f in resolved)]
    for view in views:
        lines.append(", ".join(f.value(view) + (f.unit if units else "") for f in resolved))
    return "".join(line + "\n" for line in lines)


def query_apps(views: list[GpuView], usage: Usage, fields: list[str], fmt: set[str]) -> str:
    for name in fields:
        if name not in APP_FIELDS:
            raise _invalid_field(name)
    by_uuid = {v.gpu.uuid: v for v in views}
    rows: list[tuple[int, int, dict[str, str]]] = []
    for entry in usage.entries:
        for proc in entry.procs:
            view = by_uuid.get(proc.gpu_uuid)
            if view is None:
                continue
            values = {
                "pid": str(proc.pid),
                "process_name": proc.process_name,
                "gpu_name": view.gpu.name,
                "gpu_uuid": view.gpu.uuid,
                "gpu_bus_id": view.gpu.pci_bus_id,
                "used_memory": str(proc.used_mib),
                "used_gpu_memory": str(proc.used_mib),
            }
            rows.append((view.gpu.index, proc.pid, values))
    units = "nounits" not in fmt
    lines = [] if "noheader" in fmt else [", ".join(APP_FIELDS[f][0] for f in fields)]
    for _, _, values in sorted(rows, key=lambda r: (r[0], r[1])):
        lines.append(", ".join(values[f] + (APP_FIELDS[f][1] if units else "") for f in fields))
    return "".join(line + "\n" for line in lines)


def list_gpus(views: list[GpuView]) -> str:
    return "".join(f"GPU {v.gpu.index}: {v.gpu.name} (UUID: {v.gpu.uuid})\n" for v in views)


TOPO_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def _numa_node(gpu: Gpu, count: int) -> int:
    """Explicit numa_node from gpus.json, else the first half of ≥4 GPUs on node 0, the rest on node 1."""
    if gpu.numa_node is not None:
        return int(gpu.numa_node)
    return 0 if count < 4 else (gpu.index * 2) // count


def topo_matrix(host: HostGpus) -> str:
    """`nvidia-smi topo -m`: NV12 between every pair with nvlink, else PHB within a NUMA node, SYS across."""
    gpus = list(host.gpus)
    count = len(gpus)
    cpus_per_node = 16
    header = "\t" + "".join(f"GPU{g.index}\t" for g in gpus) + "CPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    lines = [header]
    for a in gpus:
        node = _numa_node(a, count)
        cells = []
        for b in gpus:
            if a.index == b.index:
                cells.append(" X ")
            elif host.nvlink:
                cells.append("NV12")
            else:
                cells.append("PHB" if _numa_node(b, count) == node else "SYS")
        affinity = f"{node * cpus_per_node}-{node * cpus_per_node + cpus_per_node - 1}"
        lines.append(f"GPU{a.index}\t" + "\t".join(cells) + f"\t{affinity}\t{node}\t\tN/A")
    return "\n".join(lines) + "\n" + TOPO_LEGEND


def summary_table(host: HostGpus, views: list[GpuView], usage: Usage) -> str:
    """The default table (driver 5xx layout), close enough for eyeballing and for `grep MiB`."""
    bar = "+-----------------------------------------------------------------------------------------+"
    sep = "+-----------------------------------------+------------------------+----------------------+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y"), bar]
    smi = f"NVIDIA-SMI {host.driver_version}"
    drv = f"Driver Version: {host.driver_version}"
    cuda = f"CUDA Version: {host.cuda_version}"
    out.append(f"| {smi:<33} {drv:<30} {cuda:<22} |")
    out += [
        "|-----------------------------------------+------------------------+----------------------+",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    for v in views:
        name = v.gpu.name[:22]
        out.append(f"| {v.gpu.index:>3}  {name:<22}         On  | {v.gpu.pci_bus_id:>18} Off |{'0':>21} |")
        power = f"{v.power_draw:.0f}W / {v.power_limit:.0f}W"
        mem = f"{v.used_mib}MiB / {v.gpu.memory_total_mib}MiB"
        out.append(
            f"| N/A  {v.temperature:>3}C    {'P0' if v.used_mib else 'P8'}  {power:>22} |"
            f" {mem:>22} | {v.util:>6}%      Default |"
        )
        out.append("|                                         |                        |                  N/A |")
        out.append(sep)
    out += ["", bar, f"| {'Processes:':<87} |"]
    out.append("|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |")
    out.append("|        ID   ID                                                               Usage      |")
    out.append("|=========================================================================================|")
    index_of = {v.gpu.uuid: v.gpu.index for v in views}
    procs = sorted(
        ((index_of[p.gpu_uuid], p) for e in usage.entries for p in e.procs if p.gpu_uuid in index_of),
        key=lambda item: (item[0], item[1].pid),
    )
    if not procs:
        out.append(f"|  {'No running processes found':<86} |")
    for index, proc in procs:
        mem = f"{proc.used_mib}MiB"
        out.append(f"| {index:>4}   N/A  N/A {proc.pid:>10}      C   {proc.process_name[:38]:<38} {mem:>12} |")
    out.append(bar)
    return "\n".join(out) + "\n"


def run(args: list[str]) -> tuple[str, int]:
    """Compute the output text and exit status for one invocation."""
    opts = parse_args(args)
    host = load_host_gpus()
    if host is None:
        return NO_DRIVER, EXIT_NO_DRIVER
    if opts.topo:
        return topo_matrix(host), 0
    usage = Usage()
    views = gpu_views(host, opts.ids, usage)
    if opts.list_gpus:
        return list_gpus(views), 0
    if opts.query_gpu is not None:
        return query_gpu(views, opts.query_gpu, opts.fmt or {"csv"}), 0
    if opts.query_apps is not None:
        return query_apps(views, usage, opts.query_apps, opts.fmt or {"csv"}), 0
    return summary_table(host, views, usage), 0


def main(argv: list[str] | None = None) -> int:
    try:
        text, code = run(sys.argv[1:] if argv is None else argv)
    except SmiError as err:
        text, code = err.text, err.code
    sys.stdout.write(text)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
