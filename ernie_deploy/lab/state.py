"""What a running lab is made of, saved as JSON in the lab state dir so `status` and `down` (and a later
`up` after a crash) know exactly which processes, mounts and directories belong to it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.errors import DeployError

STATE_FILE = "state.json"
STATE_VERSION = 1


def state_dir() -> Path:
    """`.lab/` in the current directory unless ERNIE_LAB_DIR says otherwise (always absolute)."""
    return Path(os.environ.get("ERNIE_LAB_DIR") or ".lab").resolve()


@dataclass
class HostState:
    name: str
    address: str
    gpu_model: str
    gpu_count: int
    gpus: list[dict[str, Any]]
    machine_dir: str  # holds root/ (what the container boots) and, for overlays, upper/ and work/
    mode: str  # "overlay" or "copy"
    cgroups: list[str] = field(default_factory=list)
    pid: int | None = None
    log: str = ""
    frontend: str | None = None  # a balancer's HAProxy frontend URL, e.g. http://127.0.0.15:8080

    @property
    def root(self) -> Path:
        return Path(self.machine_dir) / "root"


@dataclass
class LabState:
    dir: str
    spec_source: str
    spec_hosts: list[dict[str, Any]]  # the validated spec, to tell "same lab again" from "different lab"
    rootfs: str
    key: str
    known_hosts: str
    inventory: str
    hosts: list[HostState]  # the GPU hosts
    started_at: float = 0.0
    ready_seconds: float | None = None
    build_seconds: float | None = None
    # The package index real-vLLM hosts install from (pkgindex.py), when the spec has such hosts.
    index_dir: str | None = None
    index_pid: int | None = None
    index_port: int | None = None
    # `role: balancer` hosts, kept apart so whatever walks the GPU hosts never meets one (no GPUs, no vLLM).
    balancers: list[HostState] = field(default_factory=list)
    version: int = STATE_VERSION

    @property
    def machines(self) -> list[HostState]:
        """Every container of the lab: GPU hosts, then balancers."""
        return [*self.hosts, *self.balancers]

    def host(self, name: str) -> HostState:
        """A GPU host or a balancer, by name."""
        for h in self.machines:
            if h.name == name:
                return h
        raise DeployError(f"no lab host named {name!r}", where=self.dir,
                          hint=f"lab hosts: {', '.join(h.name for h in self.machines)}")

    def save(self) -> None:
        """Atomic write: a crash mid-write leaves the previous state, never half a file."""
        path = Path(self.dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)


def load_state(directory: Path) -> LabState | None:
    path = directory / STATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        hosts = [HostState(**h) for h in data.pop("hosts")]
        balancers = [HostState(**h) for h in data.pop("balancers", [])]
        return LabState(hosts=hosts, balancers=balancers, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise DeployError(f"unreadable lab state: {exc}", where=str(path),
                          hint="stop leftover containers by hand, then delete the lab state dir") from exc
