"""A rollout: snapshot every host, check that nothing in scope is down already, then change the hosts batch by
batch (Ansible's `serial`), stopping when a batch fails beyond `max_fail_percentage` (or whole, or at all in
the first batch, the canary). Every host's lock is held from the snapshot to the end; where it stopped is kept
on the controller for `--resume`.

Deploy, restart and rollback share this driver: each is a `Rollout` that brings its snapshot, its per-host
change and its definition of "an instance in scope is down".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import resume
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import release_lock
from ernie_deploy.orchestration.timeline import Timeline
from ernie_deploy.orchestration.transport import RemoteHost
from ernie_deploy.planning.batches import SerialItem, batch_stops, form_batches


@dataclass(frozen=True)
class RolloutOptions:
    serial: Sequence[SerialItem] | None = None  # None: one batch of every host
    canary: int = 0
    max_fail_percentage: float | None = None
    force: bool = False  # roll out although instances in scope are down already
    preflight: bool = False  # refuse to start when instances in scope are down (rollouts; a plain deploy repairs)
    resume_key: str | None = None  # where the stopped rollout is kept; None: not kept (check mode)
    resume: bool = False
    command: str = "deploy"


@dataclass
class Report:
    batches: list[list[str]] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    stopped: str = ""  # why the rollout stopped before its last batch
    refused: list[str] = field(default_factory=list)  # instances already down (pre-flight)
    resumed: bool = False
    timeline: Timeline = field(default_factory=Timeline)


S = TypeVar("S")


class Rollout(Protocol[S]):
    """An operation the driver rolls out; S is what its snapshot leaves on each host for its change."""

    @property
    def fleet(self) -> Fleet: ...
    @property
    def report(self) -> Report: ...

    def snapshot(self, run: HostRun[S]) -> None: ...

    def change(self, run: HostRun[S], batch: int) -> None: ...

    def problems(self, run: HostRun[S]) -> list[str]:
        """Instances in scope that are down now, as "host unit: why"."""
        ...


def drive(op: Rollout[S], hosts: Sequence[RemoteHost], opts: RolloutOptions) -> list[HostResult]:
    fleet, report = op.fleet, op.report
    names = [h.name for h in hosts]
    state = _state(opts, names)
    report.resumed = state is not None
    report.batches = state.batches if state else [list(b) for b in form_batches(names, opts.serial, opts.canary)]
    report.done = list(state.done) if state else []

    def body(runs: list[HostRun[S]]) -> None:
        fleet.phase(runs, op.snapshot)
        by_name = {r.host.name: r for r in runs}
        if opts.preflight and not _preflight(runs, op.problems, opts, report):
            return
        for k in report.done:
            for name in report.batches[k]:
                run = by_name[name]
                if not run.result.finished:
                    run.result.changing().batch = k + 1
                    checked = "; re-checked: serving" if opts.preflight and not opts.force else ""
                    run.result.message = f"done in batch {k + 1} of the stopped rollout{checked}"
        first = next((k for k in range(len(report.batches)) if k not in report.done), None)
        for k, batch in enumerate(report.batches):
            if k in report.done:
                continue
            todo = [by_name[n] for n in batch]
            for run in todo:
                run.result.changing().batch = k + 1
            if report.stopped:
                for run in todo:
                    if not run.result.finished:
                        run.result.fail(Status.SKIPPED, f"not touched: {report.stopped}")
                continue
            if len(report.batches) > 1:
                report.timeline.mark("batch", f"batch {k + 1}")
                fleet.progress(batch[0], f"batch {k + 1} of {len(report.batches)}: {', '.join(batch)}")
            fleet.phase(todo, functools.partial(_numbered, op.change, k + 1))
            failed = sum(r.result.status in (Status.FAILED, Status.LOCKED) for r in todo)
            unreachable = sum(r.result.status is Status.UNREACHABLE for r in todo)
            last = k == len(report.batches) - 1
            if fleet.interrupted:
                report.stopped = f"the rollout was interrupted in batch {k + 1}"
            elif fleet.abort.is_set() and not last:
                report.stopped = f"the rollout stopped in batch {k + 1}: a host failed (--any-errors-fatal)"
            elif not failed + unreachable:
                report.done.append(k)
            elif not last and (k == first or batch_stops(failed, unreachable, len(todo), opts.max_fail_percentage)):
                what = "the first batch (canary)" if k == 0 else f"batch {k + 1}"
                report.stopped = f"the rollout stopped after {what}: {failed + unreachable} of {len(todo)} " \
                                 "host(s) failed"
            # A batch with failures is not done, stopped or not: --resume retries it.
            if report.stopped:
                report.timeline.mark("stop", report.stopped)
            _keep(opts, report)

    return [r.result for r in fleet.operate(hosts, body, release_lock)]


def _numbered(change: Callable[[HostRun[S], int], None], batch: int, run: HostRun[S]) -> None:
    change(run, batch)


def _state(opts: RolloutOptions, names: list[str]) -> resume.RolloutState | None:
    if not opts.resume:
        return None
    if opts.resume_key is None:
        raise DeployError("--resume cannot be combined with --check", hint="drop one of them")
    state = resume.load(opts.resume_key)
    if state is None:
        raise DeployError(f"no stopped {opts.command} rollout of this inventory and --limit to resume",
                          where=str(resume.path_of(opts.resume_key)),
                          hint="run it without --resume (the same inventory, --limit and --instance as the "
                               "stopped one)")
    if sorted(n for b in state.batches for n in b) != sorted(names):
        raise DeployError("the hosts differ from the stopped rollout's (inventory or --limit changed)",
                          where=str(resume.path_of(opts.resume_key)),
                          hint="resume with the same inventory and --limit, or start over without --resume")
    return state


def _keep(opts: RolloutOptions, report: Report) -> None:
    if opts.resume_key is None:
        return
    if len(report.done) == len(report.batches) or len(report.batches) == 1:  # one batch: nothing to resume
        resume.clear(opts.resume_key)
    else:
        resume.save(resume.RolloutState(opts.resume_key, opts.command, report.batches, sorted(report.done),
                                        report.stopped))


def _preflight(runs: list[HostRun[S]], problems: Callable[[HostRun[S]], list[str]], opts: RolloutOptions,
               report: Report) -> bool:
    """Before the first batch: an instance in scope already down means the rollout would take more capacity
    than allowed; refuse (naming them) unless --force."""
    for run in runs:
        if not run.result.finished:
            report.refused += problems(run)
    if not report.refused or opts.force:
        return True
    down = "; ".join(report.refused)
    for run in runs:
        if run.result.finished:
            continue
        mine = [p for p in report.refused if p.startswith(f"{run.host.name} ")]
        if mine:
            run.result.fail(Status.FAILED, f"refused to start the rollout: already down: {'; '.join(mine)}",
                            "a rollout on top of an outage takes more capacity than allowed: repair it first "
                            "(ernie-deploy deploy, or restart --instance K), or rerun with --force")
        else:
            run.result.fail(Status.SKIPPED, f"not touched: the rollout refused to start (already down: {down})")
    return False
