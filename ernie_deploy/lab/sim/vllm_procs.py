"""The simulated vLLM's child processes: the forked EngineCore and workers that hold the GPUs, and the orphan.

They only hold (registry entries name their pids for nvidia-smi) and die with the API server.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from . import simstate
from .simstate import GpuProc, UsageEntry
from .vllm_versions import Profile

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg: int | bytes) -> None:
    """Best-effort prctl(2): child processes die with the parent and carry vLLM's process names."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _exit_on_signal(signum: int, frame: Any) -> None:
    """WorkerProc.worker_main's handler: "Either SIGTERM or SIGINT will terminate the worker" by raising
    SystemExit (0.11.0 v1/executor/multiproc_executor.py:529-542, 0.34.0 :1003-1018); multiprocessing then
    reports exit code 0."""
    raise SystemExit


def _holder_main(name: str, parent: int, watch_key: str | None, exit_on_sigterm: bool = False) -> None:
    """Body of a forked EngineCore/Worker (or orphan): hold the GPU until the parent (or entry) goes.

    With `exit_on_sigterm` SIGTERM/SIGINT end it (status 0), as they end vLLM's GPU workers; otherwise they
    are ignored: the EngineCore of vLLM >= 0.18 takes SIGTERM as a drain request and keeps running until
    its API server shuts it down (0.34.0 v1/engine/core.py:1695-1716), and the orphan is a wedged process.
    """
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        handler = _exit_on_signal if exit_on_sigterm else signal.SIG_IGN
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        _prctl(PR_SET_NAME, f"VLLM::{name}".encode()[:15])
        if watch_key is None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        deadline = time.monotonic() + 7 * 24 * 3600  # a week: "forever" for a lab, yet bounded
        while time.monotonic() < deadline:
            if watch_key is None and os.getppid() != parent:
                break
            if watch_key is not None and not simstate.entry_exists(watch_key):
                break
            time.sleep(0.2)
    finally:
        os._exit(0)


def spawn_holder(name: str, exit_on_sigterm: bool) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _holder_main(name, parent, None, exit_on_sigterm)
    return pid


def spawn_orphan(procs: list[GpuProc]) -> None:
    """Double-fork a detached process that keeps holding this group's GPU memory (fault knob).

    It lives until its registry file is deleted (or a week passes), like a leaked EngineCore that only
    `kill PID` removes.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            key = f"orphan-{os.getpid()}"
            held = [GpuProc(os.getpid(), p.gpu_uuid, p.used_mib, 0, "VLLM::EngineCore") for p in procs]
            simstate.write_entry(UsageEntry(key, 0, held))
            os.write(write_fd, b"x")
            os.close(write_fd)
            _holder_main("EngineCore", 0, key)
        os._exit(0)
    os.close(write_fd)
    os.waitpid(middle, 0)
    with contextlib.suppress(OSError):
        os.read(read_fd, 1)  # wait until the orphan has registered, so nvidia-smi sees it at once
    os.close(read_fd)


@dataclass(frozen=True)
class Layout:
    """Process names and the GPU (index into the visible list) each GPU-holding process uses."""

    engine: str
    holders: tuple[tuple[str, int], ...]  # (process name, visible GPU position)

    @property
    def workers(self) -> list[str]:
        return [name for name, _ in self.holders if name.startswith("Worker")]


def make_layout(profile: Profile, tp: int, pp: int, dp: int) -> Layout:
    """vLLM names workers "Worker" + _DP/_PP/_TP suffixes for the dimensions larger than one."""
    engine = profile.engine_proc if dp == 1 else "EngineCore_DP0"
    world = tp * pp
    if world == 1 and dp == 1:
        return Layout(engine, ((engine, 0),))
    holders: list[tuple[str, int]] = []
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                name = "Worker" + (f"_DP{d}" if dp > 1 else "") + (f"_PP{p}" if pp > 1 else "")
                name += f"_TP{t}" if tp > 1 else ""
                holders.append((name, d * world + p * tp + t))
    return Layout(engine, tuple(holders))
