"""What `lab up|status|down` print. The lab's state is read through the shapes below (output/ sits below lab/
in the layers, so it names what it reads instead of importing lab.state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ernie_deploy.output import console


class LabMachine(Protocol):
    """What every container `lab up` started reports: GPU host or balancer."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def pid(self) -> int | None: ...


class LabHost(LabMachine, Protocol):
    @property
    def gpus(self) -> list[dict[str, Any]]: ...
    @property
    def gpu_model(self) -> str: ...
    @property
    def gpu_count(self) -> int: ...


class LabBalancer(LabMachine, Protocol):
    @property
    def frontend(self) -> str | None: ...


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
    @property
    def balancers(self) -> Sequence[LabBalancer]: ...


class MachineStatus(Protocol):
    """What every lab container reports: GPU host or balancer."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def pid(self) -> int | None: ...


class LabStatus(MachineStatus, Protocol):
    @property
    def gpu_model(self) -> str: ...
    @property
    def gpu_count(self) -> int: ...


class LabBalancerStatus(MachineStatus, Protocol):
    @property
    def frontend(self) -> str: ...


# HAProxy is installed but off until `deploy` configures it; the table says how to get there.
_BALANCER_NOTE = ("balancers run HAProxy once deployed: ernie-deploy deploy -i INVENTORY (group vllm_balancers; "
                  "docs/lab.md)")


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
            "balancers": [{"name": b.name, "address": b.address, "pid": b.pid, "frontend": b.frontend}
                          for b in state.balancers],
        })
        return
    console.table(None, ["host", "address", "GPUs"],
                  [(h.name, h.address, f"{h.gpu_count}× {h.gpu_model}") for h in state.hosts])
    if state.balancers:
        console.table(None, ["balancer", "address", "frontend"],
                      [(b.name, b.address, b.frontend or "-") for b in state.balancers])
        console.out.print(_BALANCER_NOTE, markup=False, highlight=False)
    console.out.print(f"inventory: {state.inventory}", markup=False, highlight=False)
    console.out.print(f"ssh: ssh -i {state.key} -o UserKnownHostsFile={state.known_hosts} "
                      f"root@{state.hosts[0].address}", markup=False, highlight=False)


def show_status(lab_dir: Path, statuses: Sequence[LabStatus], *, json: bool,
                balancers: Sequence[LabBalancerStatus] = ()) -> None:
    if json:
        console.print_json({"dir": str(lab_dir), "running": bool(statuses), "hosts": [s.__dict__ for s in statuses],
                            "balancers": [b.__dict__ for b in balancers]})
        return
    if not statuses:
        console.out.print(f"no lab is running here ({lab_dir})", markup=False, highlight=False)
        return
    console.table(f"lab in {lab_dir}", ["host", "address", "state", "pid", "GPUs"],
                  [(s.name, s.address, s.state, s.pid or "-", f"{s.gpu_count}× {s.gpu_model}") for s in statuses])
    if balancers:
        console.table(None, ["balancer", "address", "state", "pid", "frontend"],
                      [(b.name, b.address, b.state, b.pid or "-", b.frontend) for b in balancers])
        console.out.print(_BALANCER_NOTE, markup=False, highlight=False)


def show_down(stopped: bool, lab_dir: Path) -> None:
    if stopped:
        console.out.print("lab stopped and removed", markup=False, highlight=False)
    else:
        console.out.print(f"no lab was running here ({lab_dir})", markup=False, highlight=False)
