"""The fleet runner: work on many hosts phase by phase, in parallel, behind a per-host guard.

Each host has a `HostRun` (its result, open session and lock) that lives across phases, so an operation can
gather every host first and change them later, batch by batch. A phase runs a function on every host that
has not finished (failed, unreachable, locked, skipped) in a thread pool of `forks`. The guard turns every
error into that host's result: a user-facing error keeps its message and fix, an unexpected exception is a
failed host whose traceback is logged (shown with -vvv). `--any-errors-fatal` and Ctrl-C set the abort
event: hosts not started are skipped, running ones stop at their next check. `close` always runs, for
every host, so locks are released and sessions closed after a failure or an interrupt too.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.steps import Step, StepStatus
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost, Transport, target_for
from ernie_deploy.remote import lock
from ernie_deploy.remote.ssh import Failure, RemoteError, Session

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
S = TypeVar("S")


class LockHeld(DeployError):
    def __init__(self, holder: lock.LockInfo | None, host: str) -> None:
        described = holder.describe() if holder else "held (no details file)"
        if holder is not None and holder.liveness() == "dead":
            # One command for every host: a killed run leaves its lock on each host it held, and `lock --break`
            # without --limit breaks only locks whose holder is gone.
            hint = "the holder is gone: `ernie-deploy lock -i INV --break` breaks every such lock at once"
        else:
            hint = ("wait with --lock-wait SECONDS, or if that deploy is dead: "
                    f"ernie-deploy lock -i INV --limit {host} --break")
        super().__init__(f"deploy lock {described}", where=host, hint=hint)


@dataclass
class HostRun(Generic[S]):
    host: RemoteHost
    result: HostResult
    session: Transport | None = None
    lock_token: str | None = None  # set while this run holds the host's deploy lock
    state: S | None = None  # what one phase leaves for the next, typed by the operation (its snapshot, ...)


@dataclass(frozen=True)
class FleetOptions:
    forks: int = 5
    any_errors_fatal: bool = False
    known_hosts: tuple[str, ...] = ()


class Fleet:
    def __init__(self, connector: Connector, options: FleetOptions, progress: Progress | None = None) -> None:
        self.connector = connector
        self.options = options
        self.progress: Progress = progress or (lambda host, what: None)
        self.abort = threading.Event()
        self.signal: int | None = None  # the signal that stopped the run (SIGINT for Ctrl-C)

    def run(self, hosts: Sequence[RemoteHost], phases: Sequence[Callable[[HostRun[S]], None]],
            release: Callable[[HostRun[S]], None] = lambda run: None) -> list[HostRun[S]]:
        """An operation: its phases across all hosts in order, then release and close every host; signals
        stop it cleanly at any point."""

        def body(runs: list[HostRun[S]]) -> None:
            for work in phases:
                self.phase(runs, work)

        return self.operate(hosts, body, release)

    def operate(self, hosts: Sequence[RemoteHost], body: Callable[[list[HostRun[S]]], None],
                release: Callable[[HostRun[S]], None] = lambda run: None) -> list[HostRun[S]]:
        """An operation that sequences its own phases (a rollout: batches of hosts), then release and close."""
        with self.signals():
            runs: list[HostRun[S]] = [HostRun(h, HostResult(h.name)) for h in hosts]
            try:
                body(runs)
            finally:
                self.close(runs, release)
        return runs

    def connect(self, run: HostRun[Any]) -> Transport:
        if run.session is None:
            self.progress(run.host.name, "connecting")
            with self.step(run, "connect"):
                run.session = self.connector(target_for(run.host, self.options.known_hosts))
            if isinstance(run.session, Session):
                run.session.on_silence = partial(self._silent, run.host.name)
        return run.session

    def _silent(self, host: str, quiet: float, limit: float) -> None:
        self.progress(host, f"no answer for {quiet:.0f}s (gives up at {limit:.0f}s, --host-timeout)" if quiet
                      else "answers again")

    def step(self, run: HostRun[Any], name: str) -> _StepTimer:
        return _StepTimer(run.result, name)

    def phase(self, runs: Sequence[HostRun[S]], work: Callable[[HostRun[S]], None]) -> None:
        """Run `work` on every unfinished host; returns when all are done (also after Ctrl-C)."""
        todo = [r for r in runs if not r.result.finished]
        if not todo:
            return
        self._each(todo, lambda run: self._guarded(run, work))

    def _each(self, runs: Sequence[HostRun[S]], fn: Callable[[HostRun[S]], None]) -> None:
        """fn on every run, `forks` at a time; returns only when every worker has finished, also after a signal:
        a phase must never return while a worker still changes a host."""
        todo: queue.SimpleQueue[HostRun[S]] = queue.SimpleQueue()
        for run in runs:
            todo.put(run)

        count = min(max(1, self.options.forks), len(runs))
        done = [threading.Event() for _ in range(count)]

        def worker(k: int) -> None:
            try:
                while True:
                    try:
                        run = todo.get_nowait()
                    except queue.Empty:
                        return
                    fn(run)
            finally:
                done[k].set()

        with self.signals():
            for k in range(count):
                threading.Thread(target=worker, args=(k,), daemon=True, name=f"ernie-deploy-{k}").start()
            for event in done:
                while not event.wait(0.2):  # short slices: the main thread runs signal handlers promptly
                    pass

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """While a run is in progress, Ctrl-C, SIGTERM and SIGHUP stop it the same clean way: no new host is
        started, running ones stop at their next check, every lock is released, every result printed.
        The handlers only set flags, so a signal can never tear a half-started worker or skip a release.
        Operations wrap their whole run (phases and close) in it; nesting is harmless."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        def stop(signum: int, frame: object) -> None:
            if self.signal is None:
                self.signal = signum
            self.abort.set()

        for sig in STOP_SIGNALS:
            signal.signal(sig, stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def interrupted(self) -> bool:
        return self.signal is not None

    def _guarded(self, run: HostRun[S], work: Callable[[HostRun[S]], None]) -> None:
        result = run.result
        started = time.monotonic()
        try:
            if self.abort.is_set():
                why = "interrupted" if self.interrupted else "another host failed (--any-errors-fatal)"
                if result.status is Status.OK:  # nothing changed on this host yet
                    result.fail(Status.SKIPPED, f"skipped before changing anything: {why}")
                else:
                    result.fail(Status.FAILED, f"stopped after changing it: {why}", result.hint)
                return
            work(run)
        except LockHeld as exc:
            result.fail(Status.LOCKED, _message(run, exc), exc.hint)
        except RemoteError as exc:
            result.fail(Status.UNREACHABLE if exc.kind is Failure.UNREACHABLE else Status.FAILED, _message(run, exc),
                        exc.hint)
        except DeployError as exc:
            result.fail(Status.FAILED, _message(run, exc), exc.hint)
        except Exception as exc:  # the guard: one host's bug must not end the run without results
            log.debug("%s: unexpected error", run.host.name, exc_info=True)
            result.fail(Status.FAILED, f"unexpected error: {type(exc).__name__}: {exc}",
                        "rerun with -vvv for the traceback, and report it")
        finally:
            result.seconds += time.monotonic() - started
            # Set by the worker itself, so a free worker cannot pick up the next host first.
            if self.options.any_errors_fatal and result.status in (Status.FAILED, Status.UNREACHABLE, Status.LOCKED):
                self.abort.set()

    def close(self, runs: Sequence[HostRun[S]], release: Callable[[HostRun[S]], None]) -> None:
        """Release what each host holds and close its session; never skipped, never interrupted half-way."""

        def one(run: HostRun[S]) -> None:
            if run.session is None:
                return
            host = run.host.name
            try:
                release(run)
            except RemoteError as exc:
                if exc.kind is not Failure.UNREACHABLE:
                    run.result.evidence.append(f"could not release the deploy lock: {exc.message}")
                else:  # never wait for a host that stopped answering: its lock stays, and reads as stale
                    run.result.evidence.append(
                        f"could not release the deploy lock on {host}: host not answering; it will show as stale "
                        f"(once {host} answers and no deploy runs: ernie-deploy lock -i INV --limit {host} --break)")
            except DeployError as exc:
                run.result.evidence.append(f"could not release the deploy lock: {exc.message}")
            except Exception:  # closing must reach every host
                log.debug("%s: release failed", run.host.name, exc_info=True)
            finally:
                run.result.commands, run.result.command_log = run.session.commands, list(run.session.history)
                run.session.close()

        self._each(runs, one)


def _message(run: HostRun[Any], exc: DeployError) -> str:
    """The error's message, naming where it happened when that is not the host itself (a jump host)."""
    where, host = exc.where or run.host.name, run.host.name
    if where == host:
        return exc.message
    detail = where.removeprefix(host).strip() if where.startswith(host) else where  # "(jump host H:P)"
    return f"{detail} {exc.message}"


class _StepTimer:
    """Records one step of a host: its time, and failed when the block raises."""

    def __init__(self, result: HostResult, name: str) -> None:
        self.step = Step(name)
        self.result = result
        self.started = 0.0

    def __enter__(self) -> Step:
        self.started = time.monotonic()
        self.result.steps.append(self.step)
        return self.step

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.step.seconds = time.monotonic() - self.started
        self.step.ended_at = time.time()
        if kind is not None:
            self.step.status = StepStatus.FAILED
