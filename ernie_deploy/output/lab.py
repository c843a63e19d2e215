"""What `lab up|status|down` print. The lab's state is read through the shapes below (output/ sits below lab/
in the layers, so it names what it reads instead of importing lab.state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ernie_deploy.output import console


class LabHost(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def gpus(self) -> list[dict[str, Any]]: ...
    @property
    def gpu_model(self) -> str: ...
    @property
    def gpu_count(self) -> int: ...


class LabView(Protocol):
    @property
    def dir(self) -> str: ...
    @property
    def inventory(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def known_hosts(self) -> str: ...
    @property
    def rootfs(self) -> str: ...
    @property
    def build_seconds(self) -> float | None: ...
    @property
    def ready_seconds(self) -> float | None: ...
    @property
    def hosts(self) -> Sequence[LabHost]: ...


class LabStatus(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def gpu_model(self) -> str: ...
    @property
    def gpu_count(self) -> int: ...


def show_up(state: LabView, *, json: bool) -> None:
    if json:
        console.print_json({
            "dir": state.dir,
            "inventory": state.inventory,
            "key": state.key,
            "known_hosts": state.known_hosts,
            "rootfs": state.rootfs,
            "build_seconds": state.build_seconds,
            "ready_seconds": state.ready_seconds,
            "hosts": [{"name": h.name, "address": h.address, "pid": h.pid, "gpus": h.gpus} for h in state.hosts],
        })
        return
    console.table(None, ["host", "address", "GPUs"],
                  [(h.name, h.address, f"{h.gpu_count}× {h.gpu_model}") for h in state.hosts])
    console.out.print(f"inventory: {state.inventory}", markup=False, highlight=False)
    console.out.print(f"ssh: ssh -i {state.key} -o UserKnownHostsFile={state.known_hosts} "
                      f"root@{state.hosts[0].address}", markup=False, highlight=False)


def show_status(lab_dir: Path, statuses: Sequence[LabStatus], *, json: bool) -> None:
    if json:
        console.print_json({"dir": str(lab_dir), "running": bool(statuses), "hosts": [s.__dict__ for s in statuses]})
        return
    if not statuses:
        console.out.print(f"no lab is running here ({lab_dir})", markup=False, highlight=False)
        return
    console.table(f"lab in {lab_dir}", ["host", "address", "state", "pid", "GPUs"],
                  [(s.name, s.address, s.state, s.pid or "-", f"{s.gpu_count}× {s.gpu_model}") for s in statuses])


def show_down(stopped: bool, lab_dir: Path) -> None:
    if stopped:
        console.out.print("lab stopped and removed", markup=False, highlight=False)
    else:
        console.out.print(f"no lab was running here ({lab_dir})", markup=False, highlight=False)
