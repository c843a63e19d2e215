"""The rehearsal lab as a Python API: `Lab().up(spec)`, `.status()`, `.balancer_status()`, `.ssh(host, cmd)`,
`.down()`.

`up` on a lab that is already running with the same spec and reachable hosts returns the running lab
after copying the current simulators into it (nothing else changes); with a different spec it refuses
(run `down` first). Leftovers of a lab that crashed (dead PIDs, containers whose nspawn died, mounted
machine trees, stale state) are cleaned up before a new boot.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ernie_deploy.errors import DeployError
from ernie_deploy.lab import access, containers, machine, pkgindex, realvllm, rootfs, sources
from ernie_deploy.lab.spec import LabSpec, load_spec
from ernie_deploy.lab.state import HostState, LabState, load_state, state_dir

Progress = Callable[[str], None]
# Generous: 16 hosts boot in a few seconds on 2 cores, but a loaded CI machine can be much slower.
READY_TIMEOUT_BASE_S = 90.0
READY_TIMEOUT_PER_HOST_S = 5.0


@dataclass(frozen=True)
class HostStatus:
    name: str
    address: str
    state: str  # "ssh-ready", "running" (container up, sshd not answering) or "stopped"
    pid: int | None
    gpu_model: str
    gpu_count: int


@dataclass(frozen=True)
class BalancerStatus:
    name: str
    address: str
    state: str  # as HostStatus.state: whether its container runs and its sshd answers (not HAProxy's state)
    pid: int | None
    frontend: str  # where clients reach HAProxy once `deploy` configured it


def _quiet(_message: str) -> None:
    return None


def preflight() -> None:
    """Refuse early, with the fix, on machines that cannot run the lab at all."""
    if os.geteuid() != 0:
        raise DeployError("the lab needs root (it mounts file systems and boots containers)",
                          hint="run as root, e.g. sudo ernie-deploy lab up")
    missing = [tool for tool in ("systemd-nspawn", "ssh", "ssh-keygen", "mount") if shutil.which(tool) is None]
    if missing:
        raise DeployError(f"missing tools: {', '.join(missing)}",
                          hint="apt-get install systemd-container debootstrap openssh-client")


class Lab:
    """One lab, identified by its state directory (default `.lab/`, or $ERNIE_LAB_DIR)."""

    def __init__(self, directory: Path | None = None, progress: Progress | None = None) -> None:
        self.dir = (directory or state_dir()).resolve()
        self.progress = progress or _quiet

    @property
    def state(self) -> LabState | None:
        return load_state(self.dir)

    def require_state(self) -> LabState:
        state = self.state
        if state is None:
            raise DeployError("no lab is running here", where=str(self.dir), hint="run `ernie-deploy lab up`")
        return state

    # -- up ------------------------------------------------------------------------------------------

    def up(self, spec: LabSpec | None = None, inventory_out: Path | None = None) -> LabState:
        """Boot every host of `spec` (default: the bundled four-host lab) and wait until all are SSH-ready."""
        preflight()
        spec = spec or load_spec()
        started = time.monotonic()
        wanted = [*(asdict(h) for h in spec.hosts), *(asdict(b) for b in spec.balancers)]
        previous = self.state
        if previous is not None:
            same = previous.spec_hosts == wanted
            # ready_seconds is saved only by an `up` that finished; anything else is a crashed boot.
            if same and previous.ready_seconds is not None and self._healthy(previous):
                # The one thing refreshed in place: simulator edits reach running hosts without a reboot.
                for h in previous.hosts:
                    machine.install_simulators(h.root)
                sources.wheelhouse(self.dir, spec)
                self.progress(f"the lab is already running ({len(previous.machines)} hosts); "
                              "simulators refreshed, nothing else to do")
                restarted = self._ensure_index(previous, spec)
                target = inventory_out.resolve() if inventory_out is not None else Path(previous.inventory)
                if restarted or target != Path(previous.inventory):
                    self._write_inventory(previous, spec, target)
                previous.save()
                return previous
            alive = sum(1 for h in previous.machines if h.pid and containers.is_ours(h.pid, h.root))
            if not same and alive:
                raise DeployError(
                    f"a different lab is already running here ({len(previous.machines)} hosts from "
                    f"{previous.spec_source})", where=str(self.dir), hint="run `ernie-deploy lab down` first")
            self.progress(f"cleaning up a lab that is not healthy ({alive} of {len(previous.machines)} "
                          "containers still running); booting it again")
            self._teardown(previous)
        self._clean_leftovers(spec)
        self._check_addresses_free(spec)

        base, build_s = rootfs.ensure_rootfs(self.progress)
        if build_s is not None:
            self.progress(f"root file system built in {build_s:.1f} s and cached at {base}")
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        key = self.dir / "id_ed25519"
        public_key = access.ensure_key(key)
        state = LabState(
            dir=str(self.dir), spec_source=spec.source, spec_hosts=wanted, rootfs=str(base), key=str(key),
            known_hosts=str(self.dir / "known_hosts"), inventory="", hosts=[], started_at=time.time(),
            build_seconds=build_s,
        )
        try:
            self._ensure_index(state, spec)
            self._boot(state, spec, base, public_key)
            self._write_inventory(state, spec, (inventory_out or self.dir / "inventory.yml").resolve())
            state.ready_seconds = self._wait_ready(state)
        except BaseException:
            self.progress("lab up failed; stopping what it started (logs kept in " f"{self.dir / 'logs'})")
            self._teardown(state, keep_logs=True)
            raise
        state.save()
        total = time.monotonic() - started
        self.progress(f"{len(state.machines)} hosts SSH-ready {state.ready_seconds:.1f} s after boot "
                      f"(lab up took {total:.1f} s in all)")
        return state

    def _boot(self, state: LabState, spec: LabSpec, base: Path, public_key: str) -> None:
        host_keys: dict[str, str] = {}
        self.progress(f"preparing {len(spec.hosts) + len(spec.balancers)} hosts")
        for host in spec.hosts:
            hs = self._machine_state(host.name, host.address, gpu_model=host.gpu_model, gpu_count=host.gpu_count,
                                     gpus=[g.to_json() for g in host.gpus])
            state.hosts.append(hs)
            state.save()  # record the machine dir before mounting, so a crash right after can be cleaned
            hs.mode = machine.create_root(base, Path(hs.machine_dir))
            host_keys[host.address] = machine.provision(hs.root, host, public_key)
        for balancer in spec.balancers:
            hs = self._machine_state(balancer.name, balancer.address, gpu_model="", gpu_count=0, gpus=[],
                                     frontend=access.frontend_url(balancer))
            state.balancers.append(hs)
            state.save()
            hs.mode = machine.create_root(base, Path(hs.machine_dir))
            host_keys[balancer.address] = machine.provision_balancer(hs.root, balancer, public_key)
        access.write_known_hosts(Path(state.known_hosts), host_keys)
        self.progress(f"booting {len(state.machines)} containers")
        for hs in state.machines:
            Path(hs.log).write_bytes(b"")
            hs.pid = containers.start(hs.name, hs.root, Path(hs.log), [Path(c) for c in hs.cgroups])
            state.save()

    def _machine_state(self, name: str, address: str, *, gpu_model: str, gpu_count: int,
                       gpus: list[dict[str, Any]], frontend: str | None = None) -> HostState:
        return HostState(
            name=name, address=address, gpu_model=gpu_model, gpu_count=gpu_count, gpus=gpus,
            machine_dir=str(self.dir / "machines" / name), mode="",
            cgroups=[str(d) for d in containers.cgroup_dirs(self.dir, name)],
            log=str(self.dir / "logs" / f"{name}.log"), frontend=frontend,
        )

    def _wait_ready(self, state: LabState) -> float:
        boot_started = time.monotonic()
        machines = state.machines
        deadline = boot_started + READY_TIMEOUT_BASE_S + READY_TIMEOUT_PER_HOST_S * len(machines)
        key, known = Path(state.key), Path(state.known_hosts)
        # On Ctrl-C the pollers must stop at once, or the teardown would wait for the full deadline.
        cancel = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(16, len(machines)))
        try:
            futures = [pool.submit(access.wait_ssh, h.address, key, known, deadline, cancel) for h in machines]
            ready = [f.result() for f in futures]
        finally:
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
        failed = [h for h, ok in zip(machines, ready, strict=True) if not ok]
        if failed:
            h = failed[0]
            alive = h.pid is not None and containers.is_ours(h.pid, h.root)
            tail = "\n".join(Path(h.log).read_text(errors="replace").splitlines()[-20:])
            raise DeployError(
                f"{len(failed)} of {len(machines)} hosts not SSH-ready in time "
                f"({', '.join(f.name for f in failed)}); {h.name}'s container is "
                f"{'running' if alive else 'gone'}; its log ends:\n{tail}",
                where=h.log, hint="see docs/lab.md, Troubleshooting")
        return time.monotonic() - boot_started

    def _ensure_index(self, state: LabState, spec: LabSpec) -> bool:
        """Serve real vLLM's package index when the spec has real-vLLM hosts (building it once, cached);
        True when a server was (re)started, which gives the inventory a new URL."""
        if not any(h.real for h in spec.hosts):
            return False
        index, build_s = realvllm.ensure_index(self.progress)
        if build_s is not None:
            self.progress(f"real vLLM's package index built in {build_s:.1f} s and cached at {index}")
        if state.index_dir == str(index) and pkgindex.alive(state.index_pid, index):
            return False
        pkgindex.stop(state.index_pid, Path(state.index_dir or index))
        state.index_dir = str(index)
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        state.index_pid, state.index_port = pkgindex.start(index, self.dir / "logs" / "package-index.log")
        state.save()  # the PID first, so a crash right after still lets `down` stop it
        self.progress(f"real vLLM's package index serves {pkgindex.url(state.index_port)}")
        return True

    def _write_inventory(self, state: LabState, spec: LabSpec, path: Path) -> None:
        sources.wheelhouse(self.dir, spec)
        index_url = pkgindex.url(state.index_port) if state.index_port is not None else None
        access.write_inventory(path, access.inventory(spec.hosts, Path(state.key), Path(state.known_hosts),
                                                      self.dir / "wheelhouse", sources.model_source(self.dir),
                                                      index_url, os.cpu_count() or 1, spec.balancers))
        state.inventory = str(path)

    # -- leftovers -------------------------------------------------------------------------------------

    def _healthy(self, state: LabState) -> bool:
        return all(s.state == "ssh-ready" for s in self._statuses(state, state.machines, wait_s=10.0))

    def _clean_leftovers(self, spec: LabSpec) -> None:
        """Machine trees and cgroups that no state file mentions (e.g. the state file was deleted)."""
        machines = self.dir / "machines"
        if machines.is_dir():
            for d in machines.iterdir():
                machine.remove_machine(d)
        for name in [*(h.name for h in spec.hosts), *(b.name for b in spec.balancers)]:
            dirs = [str(d) for d in containers.cgroup_dirs(self.dir, name)]
            containers.kill_cgroups(dirs)
            containers.remove_cgroups(dirs)

    def _check_addresses_free(self, spec: LabSpec) -> None:
        wanted = [(h.name, h.address, 22, "sshd") for h in spec.hosts]
        for b in spec.balancers:
            wanted += [(b.name, b.address, 22, "sshd"), (b.name, b.address, access.BALANCER_PORT, "HAProxy")]
        for name, address, port, what in wanted:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((address, port))
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise
                    raise DeployError(
                        f"{address}:{port} is already in use, so {name}'s {what} could not listen there",
                        where=name,
                        hint=f"another lab (other state dir?) or a service on 0.0.0.0:{port} holds it; stop it, "
                             "or set first_address in the spec") from exc

    # -- down ------------------------------------------------------------------------------------------

    def down(self) -> bool:
        """Stop every container this lab started and remove its trees and state. False if none was up."""
        state = self.state
        if state is None:
            if self.dir.is_dir() and (self.dir / "machines").is_dir():
                for d in (self.dir / "machines").iterdir():
                    machine.remove_machine(d)
            return False
        self.progress(f"stopping {len(state.machines)} containers")
        self._teardown(state)
        return True

    def _teardown(self, state: LabState, keep_logs: bool = False) -> None:
        """Stop recorded PIDs (only those, and only while they are still our nspawn), unmount, delete."""
        def stop(h: HostState) -> None:
            if h.pid:
                containers.stop(h.pid, h.root)

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(state.machines)))) as pool:
            list(pool.map(stop, state.machines))
        if state.index_dir is not None:
            pkgindex.stop(state.index_pid, Path(state.index_dir))
        for h in state.machines:
            containers.kill_cgroups(h.cgroups)  # only does something if nspawn died without a poweroff
            containers.remove_cgroups(h.cgroups)
            machine.remove_machine(Path(h.machine_dir))
        directory = Path(state.dir)
        inventory = Path(state.inventory) if state.inventory else None
        if inventory is not None and inventory.is_file() and not inventory.is_relative_to(directory):
            inventory.unlink()
        for name in ("state.json", "known_hosts", "inventory.yml", "id_ed25519", "id_ed25519.pub", "machines",
                     "wheelhouse", "model-source"):
            p = directory / name
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        if not keep_logs:
            shutil.rmtree(directory / "logs", ignore_errors=True)
            with contextlib.suppress(OSError):  # the user keeps other files here
                directory.rmdir()

    # -- status and access -----------------------------------------------------------------------------

    def status(self) -> list[HostStatus]:
        """The GPU hosts' containers."""
        state = self.state
        return [] if state is None else self._statuses(state, state.hosts, wait_s=10.0)

    def balancer_status(self) -> list[BalancerStatus]:
        """The balancers' containers (whether HAProxy runs is `ernie-deploy status`'s business)."""
        state = self.state
        if state is None:
            return []
        return [BalancerStatus(s.name, s.address, s.state, s.pid, h.frontend or "")
                for s, h in zip(self._statuses(state, state.balancers, wait_s=10.0), state.balancers, strict=True)]

    def _statuses(self, state: LabState, machines: list[HostState], wait_s: float) -> list[HostStatus]:
        key, known = Path(state.key), Path(state.known_hosts)

        def one(h: HostState) -> HostStatus:
            running = h.pid is not None and containers.is_ours(h.pid, h.root)
            ready = running and access.wait_ssh(h.address, key, known, time.monotonic() + wait_s)
            return HostStatus(h.name, h.address, "ssh-ready" if ready else "running" if running else "stopped",
                              h.pid, h.gpu_model, h.gpu_count)

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(machines)))) as pool:
            return list(pool.map(one, machines))

    def ssh(self, host: str | HostState, command: str, *, user: str = "root", input: str | None = None,
            timeout: float = 120.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run `command` on a lab host through the real ssh client, strict host-key checking on."""
        state = self.require_state()
        h = state.host(host) if isinstance(host, str) else host
        argv = [*access.ssh_argv(h.address, Path(state.key), Path(state.known_hosts), user=user), command]
        return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, check=check)
