"""Booting and stopping one systemd-nspawn container per lab host, as plain background processes.

PID 1 of the machines this runs on is not always systemd, so nothing here talks to systemd or machined:
`--register=no --keep-unit` keep nspawn from asking for a scope unit, and each container gets a cgroup of
its own made here, because nspawn with --keep-unit puts its `payload`/`supervisor` cgroups under the
caller's cgroup, and two containers sharing one would stop each other's services.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

from ernie_deploy.errors import DeployError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_dirs(lab_dir: Path, name: str) -> list[Path]:
    """Per-container cgroups in every hierarchy nspawn uses: cgroup2 and the v1 `name=systemd` one.

    Each lies below the caller's own cgroup in that hierarchy (read from /proc/self/cgroup) and is named
    after the lab dir and host, so two labs with the same host names never share one.
    """
    lab_id = hashlib.sha256(str(lab_dir).encode()).hexdigest()[:8]
    mounts: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fstype, _source, options = [*right.split(), "", "", ""][:3]
            point = Path(left.split()[4])
            if fstype == "cgroup2":
                mounts.setdefault("", point)
            elif fstype == "cgroup" and "name=systemd" in options.split(","):
                mounts.setdefault("name=systemd", point)
    dirs: list[Path] = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers in mounts:
            dirs.append(mounts[controllers] / path.lstrip("/") / f"ernie-lab-{lab_id}-{name}")
    return dirs


def _pids_in(top: Path) -> set[int]:
    pids: set[int] = set()
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in procs.read_text().split())
    return pids


def kill_cgroups(dirs: list[str], timeout: float = 10.0) -> None:
    """SIGKILL whatever still runs in a container's own cgroups.

    Only needed when nspawn itself died without powering the container off (SIGKILL, OOM, crash): the
    container's init then lives on, reparented, still holding its sshd address. Everything in these
    cgroups descends from the nspawn this lab started there, so it is ours to stop.
    """
    tops = [Path(d) for d in dirs if Path(d).is_dir()]
    for top in tops:
        kill_file = top / "cgroup.kill"  # cgroup2 (Linux >= 5.14): kills the subtree atomically
        if kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        for pid in _pids_in(top):
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_pids_in(top) for top in tops) and time.monotonic() < deadline:
        time.sleep(0.1)


def remove_cgroups(dirs: list[str]) -> None:
    """Remove our cgroups once their processes are gone (children first; rmdir only ever empties)."""
    for top in map(Path, dirs):
        if not top.is_dir():
            continue
        subdirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*subdirs, top]:
            # Still has processes (or is not ours to remove): leave it, never fail `down`.
            with contextlib.suppress(OSError):
                d.rmdir()


def start(name: str, root: Path, log: Path, cgroups: list[Path]) -> int:
    """Boot the container in the background; returns nspawn's PID (recorded so `down` can stop it)."""
    for d in cgroups:
        d.mkdir(parents=True, exist_ok=True)
    cmd = [
        "systemd-nspawn", "--boot", "--register=no", "--keep-unit",
        f"--directory={root}", f"--machine={name}", f"--hostname={name}",
        # Share the host network (each sshd binds only its own 127.0.0.N); no console to attach to;
        # journals stay inside the container; the tree's own /etc/hosts and resolv.conf are kept.
        "--console=read-only", "--link-journal=no", "--resolv-conf=off", "--timezone=off",
    ]
    # A tiny shell moves itself into the container's cgroups before exec'ing nspawn, so nspawn never
    # runs (and creates sub-cgroups) anywhere else; the PID stays the same through the exec.
    enter = 'for g in "$@"; do [ "$g" = -- ] && break; echo $$ > "$g/cgroup.procs" || exit 70; shift; done; ' \
            'shift; exec "$@"'
    argv = ["/bin/sh", "-c", enter, "sh", *[str(d) for d in cgroups], "--", *cmd]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    return proc.pid


def is_ours(pid: int, root: Path) -> bool:
    """True if `pid` is still the nspawn booting `root` (PIDs get reused after a crash or reboot)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        _reap(pid)
        return False
    # Until the shell has exec'd, the argv is the shell's, which also names nspawn and the root.
    return any(a.endswith(b"systemd-nspawn") for a in argv) and f"--directory={root}".encode() in argv


def _reap(pid: int) -> None:
    """Collect the exit status if the process is our own child (else `kill -0` sees a zombie forever)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop(pid: int, root: Path, timeout: float = 20.0) -> None:
    """Power the container off cleanly, bounded; SIGKILL if it does not finish in time.

    On SIGTERM nspawn sends the container's systemd SIGRTMIN+3 (its "poweroff" signal) and exits when the
    container has shut down; SIGKILL to nspawn tears the whole namespace down at once.
    """
    if not is_ours(pid, root):
        return
    _signal(pid, signal.SIGTERM)
    if _wait_gone(pid, root, timeout):
        return
    _signal(pid, signal.SIGKILL)
    if not _wait_gone(pid, root, 10.0):
        raise DeployError(f"container process {pid} did not exit after SIGKILL", where=str(root),
                          hint=f"check `ps -p {pid}`; the lab state is kept so `lab down` can retry")


def _signal(pid: int, sig: signal.Signals) -> None:
    # It may have exited between the ownership check and the signal: nothing left to stop then.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_gone(pid: int, root: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not is_ours(pid, root):
            return True
        time.sleep(0.1)
    return False
