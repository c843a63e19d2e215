"""The lab spec: which simulated hosts to boot and what hardware each one pretends to have.

Pure: parsing, validation and the simulated-GPU description. No I/O beyond reading the spec file.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.errors import DeployError
from ernie_deploy.planning.versions import version_facts

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "data" / "lab-default.yml"

# Totals exactly as nvidia-smi reports them (docs/nvidia-smi.md#gpu-names-and-memory); a spec may name another
# model with its own memory.
GPU_MEMORY_MIB: dict[str, int] = {
    "NVIDIA A10": 23028,
    "NVIDIA A10G": 23028,
    "NVIDIA A100-SXM4-40GB": 40960,
    "NVIDIA A100-SXM4-80GB": 81920,
    "NVIDIA A100-PCIE-40GB": 40960,
    "NVIDIA A100 80GB PCIe": 81920,
}

# A driver new enough for every vLLM release in docs/drivers.md (0.34.0 needs 580.65.06, CUDA 13.0).
DEFAULT_DRIVER_VERSION = "580.95.05"
DEFAULT_CUDA_VERSION = "13.0"
DEFAULT_FIRST_ADDRESS = "127.0.0.11"
# Fixed namespace so a host's GPU UUIDs are the same on every lab boot (tests and inventories can pin them).
_GPU_UUID_NAMESPACE = uuid.UUID("6f1f3c2e-6c8a-4c1e-9a55-0e4e1ab0c0de")
_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_HOST_KEYS = {
    "name", "count", "gpu_model", "gpu_count", "gpu_memory_mib", "nvlink",
    "vllm_version", "faults", "driver_version", "cuda_version", "bare", "vllm", "role",
}
# `role: balancer` hosts run HAProxy in front of the lab's vLLM instances (docs/lab.md): no GPUs, no vLLM, so
# none of the keys that describe them.
ROLES = ("gpu", "balancer")
_BALANCER_KEYS = {"name", "count", "role"}
# `vllm: real` hosts run the CPU build of real vLLM (lab/realvllm.py); its version, as its metadata says.
REAL_VLLM_VERSION = "0.32.0+cpu"
VLLM_KINDS = ("sim", "real")
_TOP_KEYS = {"hosts", "first_address", "defaults"}
MAX_HOSTS = 200


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    uuid: str
    memory_total_mib: int
    pci_bus_id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "memory_total_mib": self.memory_total_mib,
            "pci_bus_id": self.pci_bus_id,
        }


@dataclass(frozen=True)
class HostSpec:
    name: str
    address: str
    gpu_model: str
    gpu_count: int
    gpu_memory_mib: int
    nvlink: bool = False
    vllm_version: str | None = None
    faults: dict[str, Any] | None = None
    driver_version: str = DEFAULT_DRIVER_VERSION
    cuda_version: str = DEFAULT_CUDA_VERSION
    bare: bool = False  # booted without vLLM, the service user and models: a box for `provision`
    vllm: str = "sim"  # "real": real vLLM (CPU build), installed by `provision`; such a host is always bare

    @property
    def real(self) -> bool:
        return self.vllm == "real"

    @property
    def installed_version(self) -> str:
        """The vLLM version a non-bare host has installed (and the lab inventory pins)."""
        if self.real:
            return REAL_VLLM_VERSION
        return self.vllm_version or version_facts().default

    @property
    def gpus(self) -> list[GPU]:
        return [
            GPU(
                index=i,
                name=self.gpu_model,
                uuid=gpu_uuid(self.name, i),
                memory_total_mib=self.gpu_memory_mib,
                pci_bus_id=pci_bus_id(i, self.gpu_count),
            )
            for i in range(self.gpu_count)
        ]

    def gpus_json(self) -> dict[str, Any]:
        """Content of /etc/ernie-lab/gpus.json, the simulators' view of the hardware."""
        return {
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "nvlink": self.nvlink,
            "gpus": [g.to_json() for g in self.gpus],
        }


@dataclass(frozen=True)
class BalancerSpec:
    """A `role: balancer` host: sshd and Debian's HAProxy package (disabled until `deploy` enables it)."""

    name: str
    address: str


@dataclass(frozen=True)
class LabSpec:
    source: str
    hosts: tuple[HostSpec, ...] = field(default_factory=tuple)  # the GPU hosts
    balancers: tuple[BalancerSpec, ...] = field(default_factory=tuple)

    def all_bare(self) -> LabSpec:
        """The same GPU hosts booted bare: no vLLM, no service user, no models (`lab up --bare`). Balancers stay
        as they are: they never have vLLM."""
        return replace(self, hosts=tuple(replace(h, bare=True) for h in self.hosts))

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)


def gpu_uuid(host: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_GPU_UUID_NAMESPACE, f'{host}/{index}')}"


def pci_bus_id(index: int, count: int) -> str:
    """Bus ids shaped like a cloud VM's: a single GPU sits at 00:1E.0 as on AWS g5 instances."""
    if count <= 4:
        return f"00000000:00:{0x1E - (count - 1) + index:02X}.0"
    return f"00000000:{0x10 + index * 0x10:02X}:00.0"


def load_spec(path: Path | None = None) -> LabSpec:
    """Read and validate a spec file (the bundled default when `path` is None)."""
    path = path or DEFAULT_SPEC
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeployError(f"cannot read lab spec: {exc.strerror}", where=str(path),
                          hint="pass an existing file to --spec") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeployError(f"not valid YAML: {exc}", where=str(path)) from exc
    return parse_spec(data, source=str(path))


def parse_spec(data: Any, *, source: str = "<spec>") -> LabSpec:
    """Validate spec data; every error names the file and key path."""

    def fail(key: str, message: str, hint: str | None = None) -> DeployError:
        return DeployError(message, where=f"{source}: {key}", hint=hint)

    if not isinstance(data, dict):
        raise fail("(top)", "the lab spec must be a mapping with a 'hosts' list",
                   hint="see docs/lab.md for the format")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise fail(sorted(unknown)[0], "unknown key", hint=f"allowed keys: {', '.join(sorted(_TOP_KEYS))}")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise fail("defaults", "must be a mapping of host keys")
    first = _parse_address(data.get("first_address", DEFAULT_FIRST_ADDRESS), fail)
    raw_hosts = data.get("hosts")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise fail("hosts", "must be a non-empty list of hosts")

    # GPU hosts and balancers in spec order: addresses follow that order across both kinds.
    hosts: list[HostSpec | BalancerSpec] = []
    for i, raw in enumerate(raw_hosts):
        key = f"hosts[{i}]"
        if not isinstance(raw, dict):
            raise fail(key, "each host must be a mapping")
        role = raw.get("role", defaults.get("role", "gpu"))
        if role not in ROLES:
            raise fail(f"{key}.role", f"{role!r} is neither gpu nor balancer",
                       hint="gpu: a simulated GPU host (the default); balancer: an HAProxy host (docs/lab.md)")
        # Defaults describe GPU hosts; a balancer takes none of them, and its own entry may name no GPU key.
        merged = {**raw} if role == "balancer" else {**defaults, **raw}
        allowed = _BALANCER_KEYS if role == "balancer" else _HOST_KEYS
        unknown = set(merged) - allowed
        if unknown:
            wrong = sorted(unknown)[0]
            if role == "balancer" and wrong in _HOST_KEYS:
                raise fail(f"{key}.{wrong}", "a balancer host has no GPUs and runs no vLLM",
                           hint=f"drop {wrong}, or drop role: balancer to make it a GPU host")
            raise fail(f"{key}.{wrong}", "unknown key", hint=f"allowed keys: {', '.join(sorted(allowed))}")
        count = merged.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise fail(f"{key}.count", "must be a positive integer")
        for n in range(count):
            replica = n if count > 1 else None
            if role == "balancer":
                hosts.append(BalancerSpec(name=_host_name(merged, key, replica, fail), address=""))
            else:
                hosts.append(_parse_host(merged, key, replica, fail))

    if len(hosts) > MAX_HOSTS:
        raise fail("hosts", f"{len(hosts)} hosts; the lab supports at most {MAX_HOSTS}")
    if not any(isinstance(h, HostSpec) for h in hosts):
        raise fail("hosts", "a lab needs at least one GPU host (every host has role: balancer)")
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise fail("hosts", f"duplicate host name {h.name!r}")
        seen.add(h.name)
    last = first + len(hosts) - 1
    if last not in ipaddress.ip_network("127.0.0.0/8"):
        raise fail("first_address", f"{len(hosts)} hosts from {first} run past 127.255.255.255")
    addressed = [replace(h, address=str(first + k)) for k, h in enumerate(hosts)]
    return LabSpec(source=source, hosts=tuple(h for h in addressed if isinstance(h, HostSpec)),
                   balancers=tuple(h for h in addressed if isinstance(h, BalancerSpec)))


def _parse_address(value: Any, fail: Any) -> ipaddress.IPv4Address:
    try:
        addr = ipaddress.IPv4Address(str(value))
    except ValueError as exc:
        raise fail("first_address", f"{value!r} is not an IPv4 address") from exc
    # 127.0.0.1 is the machine's own loopback: other services (and this machine's sshd) live there.
    if addr not in ipaddress.ip_network("127.0.0.0/8") or int(addr) <= int(ipaddress.IPv4Address("127.0.0.1")):
        raise fail("first_address", f"{addr} must be in 127.0.0.0/8 and above 127.0.0.1",
                   hint=f"use {DEFAULT_FIRST_ADDRESS}")
    return addr


def _host_name(raw: dict[str, Any], key: str, replica: int | None, fail: Any) -> str:
    name = raw.get("name")
    if not isinstance(name, str):
        raise fail(f"{key}.name", "missing or not a string")
    if replica is not None:
        name = f"{name}-{replica + 1}"
    if not _HOST_NAME.match(name):
        raise fail(f"{key}.name", f"{name!r} is not a valid host name",
                   hint="lower-case letters, digits and '-', at most 32 characters")
    return name


def _parse_host(raw: dict[str, Any], key: str, replica: int | None, fail: Any) -> HostSpec:
    name = _host_name(raw, key, replica, fail)
    model = raw.get("gpu_model", "NVIDIA A10")
    if not isinstance(model, str) or not model.strip():
        raise fail(f"{key}.gpu_model", "must be a GPU name as nvidia-smi prints it")
    memory = raw.get("gpu_memory_mib", GPU_MEMORY_MIB.get(model))
    if memory is None:
        raise fail(f"{key}.gpu_model", f"unknown GPU model {model!r}",
                   hint=f"use one of {', '.join(GPU_MEMORY_MIB)} or set gpu_memory_mib")
    if not isinstance(memory, int) or isinstance(memory, bool) or memory < 256:
        raise fail(f"{key}.gpu_memory_mib", "must be an integer number of MiB (>= 256)")

    count = raw.get("gpu_count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 16:
        raise fail(f"{key}.gpu_count", "must be an integer from 0 to 16")
    nvlink = raw.get("nvlink", False)
    if not isinstance(nvlink, bool):
        raise fail(f"{key}.nvlink", "must be true or false")
    bare = raw.get("bare", False)
    if not isinstance(bare, bool):
        raise fail(f"{key}.bare", "must be true or false")
    kind = raw.get("vllm", "sim")
    if kind not in VLLM_KINDS:
        raise fail(f"{key}.vllm", f"{kind!r} is neither sim nor real",
                   hint="sim: the simulated vLLM (seconds to start); real: vLLM's CPU build (docs/lab.md)")
    if kind == "real":
        if "bare" in raw and not bare:
            raise fail(f"{key}.bare", "a real-vLLM host is always booted bare: `provision` installs vLLM",
                       hint="drop bare: false")
        if raw.get("vllm_version") not in (None, REAL_VLLM_VERSION):
            raise fail(f"{key}.vllm_version", f"real-vLLM hosts run {REAL_VLLM_VERSION}, the CPU build the lab "
                                              "prepares", hint="drop vllm_version, or use vllm: sim")
        if raw.get("faults"):
            raise fail(f"{key}.faults", "fault knobs are the simulator's; a real-vLLM host has none",
                       hint="fail real vLLM through its inventory variables instead (docs/lab.md)")
        bare = True

    strings: dict[str, str | None] = {}
    for k in ("vllm_version", "driver_version", "cuda_version"):
        v = raw.get(k)
        if v is not None and not (isinstance(v, str) and re.fullmatch(r"[0-9][0-9A-Za-z.+-]*", v)):
            raise fail(f"{key}.{k}", f"{v!r} is not a version string", hint="quote it, e.g. \"0.11.0\"")
        strings[k] = v
    faults = raw.get("faults")
    if faults is not None and not (isinstance(faults, dict) and all(isinstance(k, str) for k in faults)):
        raise fail(f"{key}.faults", "must be a mapping (see ernie_deploy/lab/sim/README.md)")

    return HostSpec(
        name=name,
        address="",
        gpu_model=model,
        gpu_count=count,
        gpu_memory_mib=memory,
        nvlink=nvlink,
        vllm_version=strings["vllm_version"],
        faults=faults,
        driver_version=strings["driver_version"] or DEFAULT_DRIVER_VERSION,
        cuda_version=strings["cuda_version"] or DEFAULT_CUDA_VERSION,
        bare=bare,
        vllm=kind,
    )
