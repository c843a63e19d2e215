"""Host state shared by the simulated `nvidia-smi` and `vllm`: GPUs, fault knobs, live GPU usage.

Every path hangs off ``$ERNIE_LAB_ROOT`` (default ``/``) so tests can run both simulators against a
temporary directory. Standard library only: this file is copied into lab containers verbatim.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

MIB = 1024 * 1024


def lab_root() -> Path:
    return Path(os.environ.get("ERNIE_LAB_ROOT", "/"))


def gpus_path() -> Path:
    return lab_root() / "etc/ernie-lab/gpus.json"


def faults_path() -> Path:
    return lab_root() / "etc/ernie-lab/faults.json"


def version_path() -> Path:
    return lab_root() / "etc/ernie-lab/vllm_version"


def usage_dir() -> Path:
    return lab_root() / "run/ernie-lab/gpu"


# Records are NamedTuples and plain classes, not dataclasses: nvidia-smi runs this module on every call (the
# facts of every deploy, each GPU gate's reading), and importing dataclasses (with inspect) was a third of its
# start-up.
class Gpu:
    """One simulated GPU (read-only by convention)."""

    __slots__ = ("index", "memory_total_mib", "name", "numa_node", "pci_bus_id", "uuid")

    def __init__(self, index: int, name: str, uuid: str, memory_total_mib: int, pci_bus_id: str,
                 numa_node: int | None = None) -> None:
        self.index, self.name, self.uuid = index, name, uuid
        self.memory_total_mib, self.pci_bus_id, self.numa_node = memory_total_mib, pci_bus_id, numa_node

    def _key(self) -> tuple[object, ...]:
        return (self.index, self.name, self.uuid, self.memory_total_mib, self.pci_bus_id, self.numa_node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Gpu) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Gpu{self._key()!r}"


class HostGpus(NamedTuple):
    driver_version: str
    cuda_version: str
    nvlink: bool
    gpus: tuple[Gpu, ...]


def load_host_gpus() -> HostGpus | None:
    """The host's simulated GPUs, or None when gpus.json is absent (a host without a driver)."""
    try:
        raw = json.loads(gpus_path().read_text())
    except FileNotFoundError:
        return None
    gpus = tuple(
        Gpu(
            index=int(g.get("index", i)),
            name=str(g["name"]),
            uuid=str(g["uuid"]),
            memory_total_mib=int(g["memory_total_mib"]),
            pci_bus_id=str(g.get("pci_bus_id", f"00000000:{i + 0x17:02X}:00.0")),
            numa_node=g.get("numa_node"),
        )
        for i, g in enumerate(raw.get("gpus", []))
    )
    return HostGpus(
        driver_version=str(raw.get("driver_version", "550.127.05")),
        cuda_version=str(raw.get("cuda_version", "12.4")),
        nvlink=bool(raw.get("nvlink", False)),
        gpus=gpus,
    )


def load_faults(port: int | None, serve_args: Any = None) -> dict[str, Any]:
    """Fault knobs for the instance on `port`: top-level keys, overridden by ``ports["<port>"]``.

    Read fresh on every call so a test (or the lab) can flip a knob while the simulator runs.
    A missing or unreadable file means "no faults": a half-written file must not crash a server.
    An entry (the top level, or one port's) with ``"when": {"max_model_len": 1536}`` contributes its
    other knobs only when every listed serve argument of `serve_args` (the parsed `vllm serve`
    namespace) equals the value, compared as text; without `serve_args` such an entry never applies.
    """
    try:
        raw = json.loads(faults_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    if not isinstance(raw, dict):
        return {}
    merged = _entry_knobs({k: v for k, v in raw.items() if k != "ports"}, serve_args)
    per_port = raw.get("ports", {})
    if port is not None and isinstance(per_port, dict):
        entry = per_port.get(str(port), {}) or {}
        if isinstance(entry, dict):
            merged.update(_entry_knobs(entry, serve_args))
    return merged


def _entry_knobs(entry: dict[str, Any], serve_args: Any) -> dict[str, Any]:
    """An entry's knobs without its "when", or nothing when its "when" does not hold."""
    knobs = {k: v for k, v in entry.items() if k != "when"}
    if "when" not in entry:
        return knobs
    return knobs if when_matches(entry["when"], serve_args) else {}


_MISSING = object()


def when_matches(when: Any, serve_args: Any) -> bool:
    """True when every key of `when` names a serve argument whose parsed value equals the given one.

    Keys take dashes or underscores (`max-model-len`, `max_model_len`); values compare as text, so 1536
    and "1536" match, `true` matches a set flag and `null` an unset one. A list argument
    (`--served-model-name a b`) compares as its items joined by spaces.
    """
    if not isinstance(when, dict) or serve_args is None:
        return False
    for key, wanted in when.items():
        actual = getattr(serve_args, str(key).lstrip("-").replace("-", "_"), _MISSING)
        if actual is _MISSING or _as_text(actual) != _as_text(wanted):
            return False
    return True


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return " ".join(_as_text(v) for v in value)
    return str(value).strip()


def pid_alive(pid: int) -> bool:
    """True when /proc/PID exists and is not a zombie (a killed child not yet reaped is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    # The state letter follows the parenthesised command name, which may itself contain spaces.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


class GpuProc(NamedTuple):
    """One process holding memory on one GPU, as nvidia-smi --query-compute-apps lists it."""

    pid: int
    gpu_uuid: str
    used_mib: int
    reserved_mib: int
    process_name: str


class UsageEntry:
    """One registry file: a vLLM process group (or an orphan) and what it holds per GPU."""

    def __init__(self, key: str, utilization_gpu: int, procs: list[GpuProc] | None = None) -> None:
        self.key = key
        self.utilization_gpu = utilization_gpu
        self.procs: list[GpuProc] = [] if procs is None else procs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UsageEntry) and (self.key, self.utilization_gpu, self.procs) == (
            other.key, other.utilization_gpu, other.procs)

    def __repr__(self) -> str:
        return f"UsageEntry(key={self.key!r}, utilization_gpu={self.utilization_gpu!r}, procs={self.procs!r})"


def read_entries() -> list[UsageEntry]:
    """All registry entries, with the processes that are no longer alive dropped, and the real vLLM
    workers running on the host (see real_entries)."""
    entries: list[UsageEntry] = real_entries()
    directory = usage_dir()
    if not directory.is_dir():
        return entries
    for path in sorted(directory.glob("*.json")):
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        procs = [GpuProc(**p) for p in raw.get("procs", []) if pid_alive(int(p["pid"]))]
        if procs:
            entries.append(UsageEntry(path.stem, int(raw.get("utilization_gpu", 0)), procs))
    return entries


# Real vLLM (lab hosts with `vllm: real`) retitles its processes: `VLLM::EngineCore`, and under it the workers
# that would hold GPU memory on a GPU host, `VLLM::Worker` (TP 1; the CPU backend always runs a separate
# worker) or `VLLM::Worker_TP0`, `VLLM::Worker_TP1`, … (docs/lab.md).
_REAL_WORKER = re.compile(r"^VLLM::Worker(?:_TP(\d+))?$")
_GMU_FLAG = re.compile(r"^--gpu[-_]memory[-_]utilization(?:=(.*))?$")
# vLLM's own default when the flag is absent (0.32: EngineArgs.gpu_memory_utilization = 0.9).
_DEFAULT_GMU = 0.9


def _proc_words(pid: int, name: str) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return []
    return [w.decode(errors="replace") for w in raw.split(b"\0") if w]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _session(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def _api_server(pid: int) -> int | None:
    """The `vllm serve` process a worker descends from (its grandparent, through the EngineCore)."""
    for _ in range(4):
        pid = _parent(pid)
        if pid <= 1:
            return None
        if "serve" in _proc_words(pid, "cmdline"):
            return pid
    return None


def _serve_settings(api_pid: int) -> tuple[list[str] | None, float]:
    """CUDA_VISIBLE_DEVICES and --gpu-memory-utilization of a `vllm serve`: read from the API server, whose
    command line and environment are intact (the workers' are overwritten by their new titles)."""
    visible = None
    for word in _proc_words(api_pid, "environ"):
        if word.startswith("CUDA_VISIBLE_DEVICES="):
            visible = [v.strip() for v in word.split("=", 1)[1].split(",") if v.strip()]
    args = _proc_words(api_pid, "cmdline")
    gmu = _DEFAULT_GMU
    for i, word in enumerate(args):
        m = _GMU_FLAG.match(word)
        if m:
            text = m.group(1) if m.group(1) is not None else (args[i + 1] if i + 1 < len(args) else "")
            with contextlib.suppress(ValueError):
                gmu = float(text)
    return visible, gmu


def real_entries() -> list[UsageEntry]:
    """Real vLLM workers found in /proc, as the compute apps a GPU host would show: each worker holds the
    instance's share of the simulated GPU it would run on (rank r on the r-th of CUDA_VISIBLE_DEVICES),
    `--gpu-memory-utilization` of that GPU's memory, for as long as the process lives. So the GPU-release
    gate and the GPUs-in-use checks judge real process lifetimes on real-vLLM hosts."""
    host = load_host_gpus()
    if host is None:
        return []
    by_index = {str(g.index): g for g in host.gpus}
    by_uuid = {g.uuid: g for g in host.gpus}
    # Inside a lab host (ERNIE_LAB_ROOT unset or /) /proc shows only that host's processes. Run elsewhere against a
    # directory of its own (the tests, on the controller), the simulator shares /proc with everything else there,
    # a real-vLLM lab's workers included: it looks only when told which session to look in.
    session = os.environ.get("ERNIE_LAB_PROC_SESSION")
    if session is None and lab_root() != Path("/"):
        return []
    groups: dict[int, UsageEntry] = {}
    for entry in sorted(Path("/proc").iterdir(), key=lambda p: p.name):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if session is not None and _session(pid) != int(session):
            continue
        words = _proc_words(pid, "cmdline")
        m = _REAL_WORKER.match(words[0].strip()) if len(words) == 1 else None
        if m is None or not pid_alive(pid):
            continue
        api = _api_server(pid)
        if api is None:
            continue
        visible, gmu = _serve_settings(api)
        rank = int(m.group(1) or 0)
        ids = visible if visible is not None else [str(g.index) for g in host.gpus]
        if rank >= len(ids):
            continue
        gpu = by_index.get(ids[rank]) or by_uuid.get(ids[rank])
        if gpu is None:
            continue
        used = int(gpu.memory_total_mib * gmu)
        group = groups.setdefault(api, UsageEntry(f"real-vllm-{api}", 0))
        group.procs.append(GpuProc(pid, gpu.uuid, used, 0, words[0].strip()))
    return list(groups.values())


def write_entry(entry: UsageEntry) -> None:
    """Atomically (tmp + rename) publish an entry so nvidia-smi never reads half a file."""
    directory = usage_dir()
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "utilization_gpu": entry.utilization_gpu,
        "procs": [p._asdict() for p in entry.procs],
    }
    tmp = directory / f".{entry.key}.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(directory / f"{entry.key}.json")


def remove_entry(key: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (usage_dir() / f"{key}.json").unlink()


def entry_exists(key: str) -> bool:
    return (usage_dir() / f"{key}.json").exists()


@contextlib.contextmanager
def usage_lock() -> Iterator[None]:
    """Exclusive host-wide lock, so two instances starting at once cannot both pass the free check."""
    directory = usage_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def held_mib_by_gpu(exclude_key: str | None = None) -> dict[str, int]:
    """MiB held per GPU uuid by live processes, counting a reservation made before allocation."""
    held: dict[str, int] = {}
    for entry in read_entries():
        if entry.key == exclude_key:
            continue
        for proc in entry.procs:
            held[proc.gpu_uuid] = held.get(proc.gpu_uuid, 0) + max(proc.used_mib, proc.reserved_mib)
    return held


def used_mib_by_gpu(entries: list[UsageEntry]) -> dict[str, int]:
    """MiB actually allocated per GPU uuid (what nvidia-smi's memory.used shows), from read_entries()."""
    used: dict[str, int] = {}
    for entry in entries:
        for proc in entry.procs:
            used[proc.gpu_uuid] = used.get(proc.gpu_uuid, 0) + proc.used_mib
    return used


def utilization_by_gpu(entries: list[UsageEntry]) -> dict[str, int]:
    """GPU utilization per uuid (from read_entries()): the busiest process group on that GPU wins, capped at 100."""
    util: dict[str, int] = {}
    for entry in entries:
        for proc in entry.procs:
            util[proc.gpu_uuid] = min(100, max(util.get(proc.gpu_uuid, 0), entry.utilization_gpu))
    return util


def cleanup_stale_entries() -> None:
    """Delete registry files whose processes are all dead (a SIGKILLed group leaves its file behind)."""
    live = {e.key for e in read_entries()}
    directory = usage_dir()
    if not directory.is_dir():
        return
    for path in directory.glob("*.json"):
        if path.stem not in live:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
