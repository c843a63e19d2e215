"""A rollout: snapshot every host, check that nothing in scope is down already, then change the hosts batch by
batch (Ansible's `serial`), stopping when a batch fails beyond `max_fail_percentage` (or whole, or at all in
the first batch, the canary). Every host's lock is held from the snapshot to the end; where it stopped is kept
on the controller for `--resume`.

Deploy, restart and rollback share this driver: each is a `Rollout` that brings its snapshot, its per-host
change and its definition of "an instance in scope is down".

A change to serving instances is rolling unless all at once is asked for by name (`--serial all`): with
`rolling` and no serial, the hosts with nothing running go first, together (nothing serving to lose; their
failures do not stop the rest), then the others `vllm_serial` at a time (the inventory's, default 1).
Before any stop, every host is read for stray processes on the GPUs of the instances it will (re)start:
such an instance would be stopped and then could not start (docs/rolling.md). With the fleet's balancers driven
(docs/balancer.md), a balancer that cannot be driven refuses the rollout before anything changes.

The SLO gate (`RolloutOptions.slo_gate`, docs/rolling.md) gates one batch: the one whose failure stops the rollout
whatever `max_fail_percentage` says, i.e. the first batch of hosts with serving instances (the `--canary` hosts,
else the first `serial` batch; on `--resume` the first batch left), when a host of it has SLOs (vllm_slo_*).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import hooks, resume
from ernie_deploy.orchestration.balancers import BalancerControl
from ernie_deploy.orchestration.bench import SloGate, slo_vars
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import release_lock
from ernie_deploy.orchestration.timeline import Timeline
from ernie_deploy.orchestration.transport import RemoteHost
from ernie_deploy.planning.batches import SERIAL_HINT, SerialItem, batch_stops, form_batches, serial_of

SERIAL_VAR = "vllm_serial"  # the inventory's serial for rolling changes (docs/rolling.md)


@dataclass(frozen=True)
class RolloutOptions:
    serial: Sequence[SerialItem] | None = None  # None: one batch of every host, unless `rolling`
    rolling: bool = False  # without serial: serving hosts roll vllm_serial (default 1) at a time, after idle ones
    canary: int = 0
    max_fail_percentage: float | None = None
    force: bool = False  # roll out although instances in scope are down already
    preflight: bool = False  # refuse to start when instances in scope are down (rollouts; a plain deploy repairs)
    resume_key: str | None = None  # where the stopped rollout is kept; None: not kept (check mode)
    resume: bool = False
    command: str = "deploy"
    balancer_hosts: tuple[str, ...] = ()  # the inventory's balancers, driven unless --no-balancer (the output says)
    slo_gate: SloGate | None = None  # the SLO gate its cycles share (CycleOptions.slo_gate); None: no gate


@dataclass
class Report:
    batches: list[list[str]] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    stopped: str = ""  # why the rollout stopped before its last batch
    refused: list[str] = field(default_factory=list)  # instances already down (pre-flight)
    resumed: bool = False
    how: str = ""  # how the batches were formed, said before anything happens (check mode too)
    quiet: bool = False  # the first batch holds the hosts with nothing running: its failures stop nothing
    timeline: Timeline = field(default_factory=Timeline)
    rotation: hooks.Rotation = field(default_factory=hooks.Rotation)
    balancers: tuple[str, ...] = ()  # the inventory's balancer hosts
    driven: bool = False  # whether the rollout drives them (False with --no-balancer)
    balancer_problems: list[str] = field(default_factory=list)  # why the rollout refused to start (pre-flight)
    gate: str = ""  # which batch the SLO gate benches, or that it is off (said before anything happens)


S = TypeVar("S")


class Rollout(Protocol[S]):
    """An operation the driver rolls out; S is what its snapshot leaves on each host for its change."""

    @property
    def fleet(self) -> Fleet: ...
    @property
    def report(self) -> Report: ...
    @property
    def balancers(self) -> BalancerControl | None:
        """The balancers its cycles drive (None: none, or --no-balancer)."""
        ...

    def snapshot(self, run: HostRun[S]) -> None: ...

    def change(self, run: HostRun[S], batch: int) -> None: ...

    def problems(self, run: HostRun[S]) -> list[str]:
        """Instances in scope that are down now, as "host unit: why"."""
        ...

    def disrupts(self, run: HostRun[S]) -> bool:
        """Whether the host's change stops an instance that runs now."""
        ...

    def strays(self, run: HostRun[S]) -> list[tuple[str, int]]:
        """Processes outside every managed unit on the GPUs of instances the change will (re)start, as
        ("host unit: why", PID) (read from the host; nothing is touched)."""
        ...

    def put_back(self, run: HostRun[S]) -> None:
        """Run post-ready for the host's instances out of rotation (report.rotation) that serve now."""
        ...


def drive(op: Rollout[S], hosts: Sequence[RemoteHost], opts: RolloutOptions) -> list[HostResult]:
    fleet, report = op.fleet, op.report
    names = [h.name for h in hosts]
    state = _state(opts, names)
    serial = opts.serial if opts.serial is not None or not opts.rolling else inventory_serial(hosts)
    report.resumed = state is not None
    report.batches = state.batches if state else []
    report.done = list(state.done) if state else []
    kept = state or (resume.load(opts.resume_key) if opts.resume_key else None)
    report.rotation = hooks.Rotation(kept.out if kept else None)  # out of rotation in an earlier run: put back
    report.balancers, report.driven = opts.balancer_hosts, op.balancers is not None
    lock = threading.Lock()

    def save() -> None:
        with lock:
            _keep(opts, report)

    def body(runs: list[HostRun[S]]) -> None:
        fleet.phase(runs, op.snapshot)
        by_name = {r.host.name: r for r in runs}
        if state is None:
            _form(op, runs, opts, serial, report)
        _gate(runs, opts, report)
        report.rotation.saved = save
        try:
            _batches(op, runs, by_name, opts, report)
        finally:
            save()
            _name_out_of_rotation(runs, report)

    return [r.result for r in fleet.operate(hosts, body, release_lock)]


def _batches(op: Rollout[S], runs: list[HostRun[S]], by_name: dict[str, HostRun[S]], opts: RolloutOptions,
             report: Report) -> None:
    fleet = op.fleet
    if not _balancers_ready(runs, op, report):
        return
    if opts.resume_key is not None:
        fleet.phase([r for r in runs if report.rotation.out_of(r.host.name)], op.put_back)
    if not _preflight(runs, op, opts, report):
        return
    for k in report.done:
        for name in report.batches[k]:
            run = by_name[name]
            if not run.result.finished:
                run.result.changing().batch = k + 1
                checked = "; re-checked: serving" if opts.preflight and not opts.force else ""
                run.result.message = f"done in batch {k + 1} of the stopped rollout{checked}"
    first = _first(report)
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
        elif k == 0 and report.quiet:
            pass  # nothing was serving on these hosts; --resume retries them
        elif not last and (k == first or batch_stops(failed, unreachable, len(todo), opts.max_fail_percentage)):
            what = "the first batch (canary)" if k == 0 else f"batch {k + 1}"
            report.stopped = f"the rollout stopped after {what}: {failed + unreachable} of {len(todo)} " \
                             "host(s) failed"
        # A batch with failures is not done, stopped or not: --resume retries it.
        if report.stopped:
            report.timeline.mark("stop", report.stopped)
        _keep(opts, report)


def _first(report: Report) -> int | None:
    """The batch whose failure stops the rollout whatever max_fail_percentage says (0-based): the first one left
    that is not the hosts with nothing running."""
    return next((k for k in range(len(report.batches)) if k not in report.done and not (k == 0 and report.quiet)),
                None)


def _gate(runs: list[HostRun[S]], opts: RolloutOptions, report: Report) -> None:
    """Name the SLO gate's batch (that batch's first one, `_first`) when a host of it has SLOs, and say so: in the
    report and in each gated host's result (check mode too). Off (--no-slo-gate): say which hosts go unbenched."""
    gate = opts.slo_gate
    k = _first(report)
    if gate is None or k is None:
        return
    gate.batch = None
    by_name = {r.host.name: r for r in runs}
    gated = {name: slo_vars(by_name[name].host.vars) for name in report.batches[k] if name in by_name}
    gated = {name: found for name, found in gated.items() if found and not by_name[name].result.finished}
    if not gated:
        return
    hosts = ", ".join(gated)
    if not gate.enabled:
        report.gate = f"SLO gate off: batch {k + 1} ({hosts}) has SLOs and is not benched"
        return
    gate.batch = k + 1
    report.gate = (f"SLO gate: batch {k + 1} ({hosts}) is benched after its checks (vllm bench serve); an instance "
                   "that misses its SLOs fails like a failed start (rolled back) and the rollout stops")
    for name, found in gated.items():
        limits = ", ".join(f"{var} {value}" for var, value in found.items())
        by_name[name].result.evidence.append(f"SLO gate (batch {k + 1}): each (re)started instance is benched after "
                                             f"its checks against {limits}")


def inventory_serial(hosts: Sequence[RemoteHost]) -> list[SerialItem]:
    """The inventory's `vllm_serial` (the same on every host in scope), else 1."""
    values = {h.name: str(h.vars[SERIAL_VAR]).strip() for h in hosts if h.vars.get(SERIAL_VAR) is not None}
    if len(set(values.values())) > 1:
        listed = ", ".join(f"{h}: {v}" for h, v in sorted(values.items()))
        raise DeployError(f"{SERIAL_VAR} differs between the hosts in scope ({listed})",
                          where=next(iter(sorted(values))),
                          hint=f"a rollout has one serial: set {SERIAL_VAR} once (group_vars/all), or pass --serial")
    if not values:
        return [1]
    host, text = sorted(values.items())[0]
    try:
        return serial_of(text, SERIAL_VAR)
    except DeployError as exc:
        raise DeployError(exc.message, where=host, hint=exc.hint or SERIAL_HINT) from None


def _describe(serial: Sequence[SerialItem]) -> str:
    if list(serial) == [0]:
        return "every host at once"
    if list(serial) == [1]:
        return "one host at a time"
    return f"serial {','.join(map(str, serial))}"


def _form(op: Rollout[S], runs: list[HostRun[S]], opts: RolloutOptions, serial: Sequence[SerialItem] | None,
          report: Report) -> None:
    names = [r.host.name for r in runs]
    if not opts.rolling or opts.serial is not None:
        report.batches = [list(b) for b in form_batches(names, serial, opts.canary)]
        if len(report.batches) == 1 and len(names) > 1:
            report.how = "every host at once" + (" (--serial all)" if opts.rolling else "")
        elif len(names) > 1:
            report.how = f"{len(report.batches)} batches ({_describe(serial or [0])})"
        return
    assert serial is not None
    quiet = [r.host.name for r in runs if r.result.finished or not op.disrupts(r)]
    busy = [n for n in names if n not in quiet]
    rolled = [list(b) for b in form_batches(busy, serial, opts.canary)]
    report.quiet = bool(quiet and rolled)
    report.batches = ([quiet] if quiet else []) + rolled
    if busy:
        report.how = f"rolling: hosts with serving instances go {_describe(serial)} (--serial all: every host at " \
                     "once)" + ("; hosts with nothing running first, together" if report.quiet else "")


def _balancers_ready(runs: list[HostRun[S]], op: Rollout[S], report: Report) -> bool:
    """Before anything changes (and before --resume puts instances back): when the rollout drives balancers and
    stops an instance that serves, every balancer must be drivable; otherwise refuse, naming each."""
    lb = op.balancers
    live = [r for r in runs if not r.result.finished]
    owed = any(report.rotation.out_of(r.host.name) for r in live)  # --resume sets those ready
    if lb is None or not (owed or any(op.disrupts(r) for r in live)):
        return True
    report.balancer_problems = lb.unreachable()
    if not report.balancer_problems:
        return True
    said = "; ".join(report.balancer_problems)
    for run in live:
        run.result.fail(Status.FAILED, f"refused to start the rollout: a balancer cannot be driven: {said}",
                        "fix the balancer as the message says and rerun; or rerun with --no-balancer if it is down "
                        "and you accept losing the requests sent to each instance while it restarts")
    return False


def _name_out_of_rotation(runs: list[HostRun[S]], report: Report) -> None:
    """Every instance still out of the load balancer, named in its host's result (text and JSON)."""
    for run in runs:
        for unit in report.rotation.out_of(run.host.name):
            run.result.checks.append(CheckResult(
                "rotation", "fail", f"{unit} is out of the load balancer: taken out before its restart (drained "
                "on its balancer, or its pre-drain hook ran) and not put back (it does not serve, or the rollout "
                "stopped first)", instance=unit.removesuffix(".service"),
                fix="rerun with --resume: it is set ready on its balancer and post-ready runs, once it serves (or "
                    "put it back by hand)"))


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
    out = report.rotation.snapshot()
    # One batch that did not complete: a plain rerun does the same, only instances out of rotation need keeping.
    if not out and (len(report.done) == len(report.batches) or len(report.batches) == 1):
        resume.clear(opts.resume_key)
    else:
        resume.save(resume.RolloutState(opts.resume_key, opts.command, report.batches, sorted(report.done),
                                        report.stopped, out=out))


def _preflight(runs: list[HostRun[S]], op: Rollout[S], opts: RolloutOptions, report: Report) -> bool:
    """Before the first batch: a stray process on the GPUs of an instance to (re)start refuses that host (it would
    be stopped and then could not start; --force does not change that); an instance in scope already down means
    the rollout would take more capacity than allowed: refuse (naming them) unless --force."""
    live = [r for r in runs if not r.result.finished and any(r.host.name in b for b in _todo(report))]
    strays: dict[str, list[tuple[str, int]]] = {}

    def read(run: HostRun[S]) -> None:
        strays[run.host.name] = op.strays(run)

    op.fleet.phase(live, read)
    for run in live:
        found = strays.get(run.host.name)
        if found and not run.result.finished:
            pids = " ".join(sorted({str(pid) for _, pid in found}))
            run.result.fail(Status.FAILED, "refused before stopping anything: " + "; ".join(w for w, _ in found),
                            f"check what it is (ps -o pid,user,cmd -p {pids}), stop it (kill {pids}), then rerun: "
                            "stopped now, the instance could not start again (vLLM's free-memory check fails "
                            "while another process holds the memory); its instances keep serving")
    # On --resume, the batch the stopped run was changing may have an instance down because of that run (killed
    # between a stop and a start): retrying that batch is the repair, not a reason to refuse.
    retried = set(_todo(report)[0]) if report.resumed and _todo(report) else set()
    if opts.preflight:
        for run in runs:
            if run.result.finished:
                continue
            found_down = op.problems(run)
            if run.host.name in retried:
                run.result.evidence += [f"down when resumed (its batch is retried): {p}" for p in found_down]
            else:
                report.refused += found_down
    stray = [what for found in strays.values() for what, _ in found]
    if not (report.refused or stray) or opts.force or not opts.preflight:  # a plain deploy repairs
        return True
    down = "; ".join(report.refused + stray)
    for run in runs:
        if run.result.finished:
            continue
        mine = [p for p in report.refused if p.startswith(f"{run.host.name} ")]
        if mine:
            run.result.fail(Status.FAILED, f"refused to start the rollout: already down: {'; '.join(mine)}",
                            "a rollout on top of an outage takes more capacity than allowed: repair it first "
                            "(ernie-deploy deploy, or restart --instance K), or rerun with --force")
        else:
            run.result.fail(Status.SKIPPED, f"not touched: the rollout refused to start (refused: {down})")
    return False


def _todo(report: Report) -> list[list[str]]:
    return [b for k, b in enumerate(report.batches) if k not in report.done]
