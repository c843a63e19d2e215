"""Helpers for lab tests: bounded polling, hand-written systemd units that clean up after themselves, and the
lab's inventory with or without its balancer group."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.lab import BalancerSpec, Lab, LabState
from ernie_deploy.lab.access import BALANCER_GROUP, balancer_group


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass (always bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Units:
    """Hand-written systemd units on lab hosts; every unit made here is stopped and removed afterwards."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.made: list[tuple[str, str]] = []

    def start(self, host: str, name: str, exec_start: str, env: dict[str, str] | None = None,
              extra: str = "") -> None:
        env_lines = "".join(f"Environment={k}={v}\n" for k, v in (env or {}).items())
        unit = (f"[Unit]\nDescription=lab test {name}\n[Service]\nType=simple\nUser=vllm\n{env_lines}"
                f"ExecStart={exec_start}\n{extra}")
        self.made.append((host, name))
        done = self.lab.ssh(host, f"cat > /etc/systemd/system/{name}.service && systemctl daemon-reload && "
                                  f"systemctl start {name}.service", input=unit)
        assert done.returncode == 0, done.stderr

    def state(self, host: str, name: str) -> str:
        return self.lab.ssh(host, f"systemctl is-active {name}.service").stdout.strip()

    def journal(self, host: str, name: str) -> str:
        return self.lab.ssh(host, f"journalctl -u {name}.service --no-pager -o cat").stdout

    def wait_state(self, host: str, name: str, wanted: str, timeout: float = 30.0) -> str:
        wait_for(lambda: self.state(host, name) == wanted, timeout, interval=0.3)
        return self.state(host, name)

    def cleanup(self) -> None:
        for host, name in reversed(self.made):
            self.lab.ssh(host, f"systemctl stop {name}.service; systemctl reset-failed {name}.service; "
                               f"rm -f /etc/systemd/system/{name}.service; systemctl daemon-reload")


def drop_balancers(path: Path) -> None:
    """Remove the `vllm_balancers` group from an inventory `lab up` wrote. The lab tests that predate the balancer
    deploy and restart with this inventory; with the group they would configure HAProxy and drive it on every
    restart, which is test_lab_balancer.py's business (it adds the group back with `inventory(balancers=True)`)."""
    data = yaml.safe_load(path.read_text())
    if data["all"]["children"].pop(BALANCER_GROUP, None) is not None:
        path.write_text(yaml.safe_dump(data, sort_keys=False))


def inventory(state: LabState, directory: Path, name: str = "inventory.yml", *, balancers: bool = False,
              host_vars: dict[str, dict[str, Any]] | None = None) -> Path:
    """A copy of the lab's inventory in `directory`, `host_vars` (host → variables) merged in, in whichever group
    the host is, and, with `balancers`, the lab's `vllm_balancers` group as `lab up` writes it."""
    data = yaml.safe_load(Path(state.inventory).read_text())
    groups = data["all"]["children"]
    if balancers:
        specs = [BalancerSpec(b.name, b.address) for b in state.balancers]
        groups[BALANCER_GROUP] = balancer_group(specs, Path(state.key), Path(state.known_hosts))
    for host, extra in (host_vars or {}).items():
        owner = next((g for g in groups.values() if host in (g.get("hosts") or {})), None)
        assert owner is not None, f"{host} is in no group of {state.inventory}"
        owner["hosts"][host].update(extra)
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


CLEAN = ("for u in $(systemctl list-units --all --plain --no-legend 'ernie-vllm-*' | awk '{print $1}'); do "
         "systemctl disable --now -q $u; systemctl reset-failed $u; done 2>/dev/null; "
         "rm -rf /etc/systemd/system/ernie-vllm-* /etc/ernie-deploy /var/lib/ernie-deploy /var/log/ernie-deploy; "
         "systemctl daemon-reload")


def clean(lab: Lab, state: LabState) -> None:
    for h in state.hosts:
        lab.ssh(h.name, CLEAN)


@contextlib.contextmanager
def cleaned(lab: Lab, state: LabState) -> Iterator[LabState]:
    """The lab with every host cleaned before and after (other lab tests need free GPUs, and no unit of this
    one's, such as one that requires an API key, may outlive it)."""
    clean(lab, state)
    try:
        yield state
    finally:
        clean(lab, state)
