"""Deploy: converge hosts to their plans, phase by phase across hosts.

0. the selected balancers first (docs/balancer.md): each one's HAProxy configuration rendered, checked and
   applied, so it knows every instance before any of them changes; one that fails stops the deploy here;
1. snapshot every host (connect, lock + facts in one command, plan, render, changes);
2. change the hosts, batch by batch (rollout.py: with `rolling`, the command line's default, hosts whose change
   stops serving instances go one at a time or `vllm_serial` at a time; `--serial all`: one batch): show
   diffs, stage (files in place, a release recorded, nothing restarted), then cycle each changed instance
   one at a time (cycle.py: drain, stop, GPU release, start, readiness, checks); a failed one is restored
   to the release that ran before; facts are re-read first when the snapshot has grown old;
3. close: release every lock and close every session, also after a failure or Ctrl-C.

With one batch a host's failure never stops the others unless `any_errors_fatal` is set.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.orchestration import audit
from ernie_deploy.orchestration.balancers import BalancerControl
from ernie_deploy.orchestration.cycle import (
    CycleOptions,
    HostCycle,
    Work,
    first_start,
    put_back,
    stray_processes,
    unit_of,
)
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.rollout import Report, RolloutOptions, drive
from ernie_deploy.orchestration.snapshot import (
    Snapshot,
    SnapshotOptions,
    down,
    refresh,
    take,
)
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost, Transport
from ernie_deploy.planning.balancer import BalancerPlan
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.remote import converge, lock, releases
from ernie_deploy.remote.balancer import Applied
from ernie_deploy.remote.protocol import MARK


class BalancerSetup(Protocol):
    """What deploy needs of the selected balancers (orchestration/balancers.py `Balancers`)."""

    def apply(self, render: Callable[[BalancerPlan], str], *, who: lock.LockInfo | None = None,
              check: bool = False) -> dict[str, Applied]: ...

    def results(self) -> list[HostResult]: ...


@dataclass(frozen=True)
class Options:
    check: bool = False
    diff: bool = False
    prune: bool = False
    forks: int = 5
    any_errors_fatal: bool = False
    lock_wait: float = 0.0
    health_timeout: float = 0.0  # 0: each host's vllm_startup_budget
    command: str = "ernie-deploy deploy"
    known_hosts: tuple[str, ...] = ()
    templates: Path | None = None  # None: the bundled templates
    recheck_after: float = 30.0  # re-read a host's facts before changing it when its snapshot is older
    stable: float | None = None  # seconds an instance must stay healthy (None: each host's vllm_stable_seconds)
    poll: float = 0.5  # seconds between readiness polls
    cycle: CycleOptions = field(default_factory=CycleOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    activate: bool = True  # False: stage the files and stop (a playbook's converge; its rolling task restarts)
    # The selected balancers (None: none selected, or --no-balancer) and how their configuration is rendered.
    balancer_setup: BalancerSetup | None = None
    render_balancer: Callable[[BalancerPlan], str] | None = None


def ran_before(kept: list[releases.Release], snap: Snapshot) -> dict[str, releases.Release]:
    """Per unit, the release it runs now: restored when its change fails. A unit staged by an earlier run and
    not restarted since runs the release recorded when it was first staged, not the files installed now."""
    units = [unit_of(i) for i in snap.plan.instances]
    out = releases.running_releases(kept, snap.facts.files, units)
    by_id = {r.id: r for r in kept}
    for unit in units:
        rid = snap.facts.pending_from.get(unit)
        if unit in snap.facts.pending and rid in by_id:
            out[unit] = by_id[rid]
    return out


class Runner:
    """One deploy (or check) run over many hosts."""

    def __init__(self, ctx: PlanContext, connector: Connector, options: Options,
                 progress: Progress | None = None, expectations: Expectations | None = None,
                 fleet: Fleet | None = None) -> None:
        """`fleet`: run on this one (a playbook's task) instead of one of the options' own."""
        self.ctx = ctx
        self.options = options
        self.report = Report()
        self.cycle = dataclasses.replace(options.cycle, health_timeout=options.health_timeout, stable=options.stable,
                                         poll=options.poll)
        self.fleet = fleet or Fleet(connector, FleetOptions(options.forks, options.any_errors_fatal,
                                                            options.known_hosts), progress)
        self.templates = unit_environment(options.templates)
        self.lock = lock.LockInfo.mine(options.command)
        self.expectations = expectations or Expectations()

    @property
    def stopped_by(self) -> int | None:
        """The signal that stopped the run (Ctrl-C: SIGINT), or None."""
        return self.fleet.signal

    @property
    def balancers(self) -> BalancerControl | None:
        return self.cycle.balancers

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        """The balancers' results first (when selected), then the hosts'. A balancer whose configuration failed
        stops the deploy before any host is touched (check mode goes on: it says what each host would do)."""
        setup, render = self.options.balancer_setup, self.options.render_balancer
        if setup is None or render is None:
            return drive(self, hosts, self.options.rollout)
        applied = self._apply(setup, render)
        failed = [r.host for r in applied if r.finished]
        if failed and not self.options.check:
            why = f"not touched: the configuration of balancer {', '.join(failed)} failed (its result says why)"
            return applied + [HostResult(h.name, Status.SKIPPED, why) for h in hosts]
        return applied + drive(self, hosts, self.options.rollout)

    def _apply(self, setup: BalancerSetup, render: Callable[[BalancerPlan], str]) -> list[HostResult]:
        """Render, check (`haproxy -c`) and apply each selected balancer's configuration; a result per balancer
        host: changed (reloaded without dropping connections, or started), unchanged, or failed quoting HAProxy."""
        check = self.options.check
        results = {r.host: r for r in setup.results()}
        for name in results:
            self.fleet.progress(name, "balancer configuration" + (" (check mode)" if check else ""))
        done = setup.apply(render, who=self.lock, check=check)
        results = {r.host: r for r in setup.results()}  # with the apply's steps and commands
        out = []
        for host, applied in done.items():
            result = results.get(host) or HostResult(host)
            first, *rest = applied.describe().splitlines() or [""]
            if not applied.ok:
                result.fail(Status.FAILED, f"balancer: {first}", applied.hint)
                result.evidence += rest
            elif applied.changed or applied.installed or applied.started:
                result.status = Status.CHANGED
                result.message = f"balancer: {first}" + (" (check mode: nothing was touched)" if check else "")
            else:
                result.status, result.message = Status.OK, f"balancer: {first}"
            out.append(result)
        return out

    @property
    def _snapshot_options(self) -> SnapshotOptions:
        return SnapshotOptions(lock=None if self.options.check else self.lock, lock_wait=self.options.lock_wait,
                               prune=self.options.prune, lock_later=True,
                               take_over_stale=self.options.rollout.resume)

    def problems(self, run: HostRun[Snapshot]) -> list[str]:
        """Installed instances of the plan that do not serve now (the rollout pre-flight). A unit staged and never
        started (a playbook's converge before its rolling task) is new, not down."""
        snap = run.state
        if snap is None:
            return []
        facts = snap.facts
        units = [unit_of(i) for i in snap.plan.instances]
        fresh = {u for u in units if u in facts.pending and u in facts.units
                 and facts.units[u].active_state not in converge.RUNNING and not facts.units[u].invocation_id}
        return down(run.host.name, snap, [u for u in units if u not in fresh], installed_only=True)

    def snapshot(self, run: HostRun[Snapshot]) -> None:
        run.state = take(self.fleet, run, self.ctx, self.templates, self._snapshot_options)

    def disrupts(self, run: HostRun[Snapshot]) -> bool:
        snap = run.state
        return snap is not None and bool(snap.changes.restart or snap.changes.prune)

    def strays(self, run: HostRun[Snapshot]) -> list[tuple[str, int]]:
        snap = run.state
        # A host with nothing running loses nothing: a stray there fails the GPU gate before the first start.
        if snap is None or run.session is None or not self.disrupts(run) or not self.options.activate:
            return []
        changes = snap.changes
        insts = [i for i in snap.plan.instances if unit_of(i) in changes.units]
        return stray_processes(run.session, snap.plan, insts, [*changes.prune, *changes.leftover])

    def put_back(self, run: HostRun[Snapshot]) -> None:
        snap = run.state
        if snap is not None:
            stable = snap.plan.tuning.stable_seconds
            put_back(self.fleet, run, snap.plan,
                     lambda unit: converge.serving_problem(unit, snap.facts, stable) is None,
                     self.report.rotation, self.cycle)

    def change(self, run: HostRun[Snapshot], batch: int) -> None:
        snap = run.state
        if snap is None:
            return
        opts, result, session = self.options, run.result, run.session
        assert session is not None
        if not opts.check and time.monotonic() - snap.taken > opts.recheck_after:
            snap = run.state = refresh(self.fleet, run, snap, opts.prune)
        if not opts.check and run.lock_token is None and not snap.changes.empty:
            # Read without the lock (nothing to change then) and changed since: lock, and look again.
            snap = run.state = refresh(self.fleet, run, snap, opts.prune, lock=self._snapshot_options)
        changes, done = snap.changes, result.changing()
        done.changed_files = [c.path for c in changes.files]
        done.restarted, done.started = list(changes.restart), list(changes.start)
        done.enabled, done.pruned, done.reasons = list(changes.enable), list(changes.prune), changes.reasons
        done.leftover, done.dropins = list(changes.leftover), list(changes.dropins)
        if opts.diff and (changes.files or changes.dropins):
            done.diffs = self._diffs(session, snap)
        blocked = self._blocked(snap)
        if blocked is not None:
            message, hint = blocked
            result.fail(Status.FAILED, message + (" (check mode)" if opts.check else ""), hint)
            return
        leftover = f"; not in the plan (remove with --prune): {', '.join(changes.leftover)}" \
            if changes.leftover and not opts.prune else ""
        if changes.empty:
            result.status = Status.OK
            result.message = "nothing to change: units and env files match, all serving" + leftover
            return
        result.status = Status.CHANGED
        work = self._work(snap, batch)
        how = self._how(work)
        if opts.check:
            result.message = f"would change (check mode: nothing was touched){how}" + leftover
            return
        if self.fleet.abort.is_set():
            result.fail(Status.SKIPPED, "skipped before changing anything: run aborted")
            return
        if changes.files or changes.units:
            work.undo_to = ran_before(releases.parse_list(session.run(releases.list_command()).text), snap)
        self._stage(run, snap, work)
        if not opts.activate:
            staged = f"staged {len(changes.files)} file(s)" if changes.files else "nothing to stage"
            units = ", ".join(changes.units)
            result.status = Status.CHANGED if changes.files else Status.OK
            result.message = staged + (f"; waiting for a restart: {units}" if units else "") + leftover
            return
        audited: Callable[[str], dict[str, Any]] = lambda action: self._audit(run, action, changes)  # noqa: E731
        if not work.instances:
            with self.fleet.step(run, "activate") as step:
                session.run(converge.activate_command(changes, audited("activate")))
                step.changed = True
            result.message = "changed" + leftover
            return
        if not HostCycle(self.fleet, run, work, self.cycle, self.expectations, self.report.timeline, audited,
                         self.report.rotation).go():
            return
        result.message = f"changed; every (re)started instance verified{how}" + leftover

    def _work(self, snap: Snapshot, batch: int) -> Work:
        changes, facts, plan = snap.changes, snap.facts, snap.plan
        stable = plan.tuning.stable_seconds
        return Work(plan, [i for i in plan.instances if unit_of(i) in changes.units], running=set(changes.restart),
                    serving={u for u in changes.restart if converge.serving_problem(u, facts, stable) is None},
                    whole=converge.moved_gpus(plan, facts), activation=changes, batch=batch,
                    stop_first=changes.prune)

    def _how(self, work: Work) -> str:
        if not work.instances:
            return ""
        if work.whole:
            return "; the host goes as a whole (GPUs move: " + "; ".join(work.whole) + ")"
        if len(work.instances) > 1 and not self.cycle.parallel_instances:
            return "; instances one at a time"
        return ""

    def _blocked(self, snap: Snapshot) -> tuple[str, str] | None:
        """Why this host must not be changed at all (message, fix), decided before anything is touched."""
        changes, facts = snap.changes, snap.facts
        if changes.dropins and not self.options.prune:
            return (f"drop-in files override managed units: {', '.join(changes.dropins)}",
                    "they change what runs without the plan knowing (systemctl edit?): fold the setting into the "
                    "inventory and rerun with --prune to remove them, or delete them yourself")
        if self.options.prune:
            return None
        for unit in changes.leftover:
            held = converge.held_gpus(snap.plan, facts, unit)
            if held:
                return (f"{unit} is not in the plan but runs on GPU(s) {', '.join(map(str, held))}, which the plan "
                        "needs", f"rerun with --prune to stop and remove {unit} (or stop it yourself)")
        return None

    def _diffs(self, session: Transport, snap: Snapshot) -> list[str]:
        changes = snap.changes
        existing = [c.path for c in changes.files if c.old_sha256] + list(changes.dropins)
        old = converge.parse_read(session.run(converge.read_command(existing)).text) if existing else {}
        by_path = {f.path: f for f in snap.files}
        diffs = [converge.unified_diff(c.path, old.get(c.path) if c.old_sha256 else None, by_path[c.path].content,
                                       c.secret) for c in changes.files]
        return diffs + [converge.unified_diff(d, old.get(d, ""), "", False, new_label="removed with --prune")
                        for d in changes.dropins]

    def _audit(self, run: HostRun[Snapshot], action: str, changes: converge.Changes) -> dict[str, object]:
        return audit.record(self.lock, run.host.name, action,
                            files=[{"path": c.path, "old_sha256": c.old_sha256, "new_sha256": c.new_sha256}
                                   for c in changes.files],
                            restart=list(changes.restart), start=list(changes.start), prune=list(changes.prune))

    def _stage(self, run: HostRun[Snapshot], snap: Snapshot, work: Work) -> None:
        """Stage the files (recording a release); nothing is restarted. When the cycle's first start has nothing
        to stop first, the same command reads its GPUs for the gate (`work.reading`)."""
        assert run.session is not None
        changes, name, ran = snap.changes, run.host.name, work.undo_to
        # Units that only need a (re)start are found again by the next run; a release is a set of files.
        if not changes.files:
            return
        self.fleet.progress(name, f"staging {len(changes.files)} file(s)")
        entry = self._audit(run, "stage", changes)
        rid = converge.release_id(snap.files, time.time())
        release = {**entry, "id": rid, "files": {f.path: f.sha256 for f in snap.files},
                   "changed": [c.path for c in changes.files]}
        keep = max(1, snap.plan.tuning.keep_releases)
        gpu_units = first_start(work, self.cycle) if self.options.activate else []
        with self.fleet.step(run, "stage") as step:
            out = run.session.run(converge.stage_command(snap.files, changes, entry, release, keep,
                                                         tuple(sorted({r.id for r in ran.values()})),
                                                         {u: r.id for u, r in ran.items()}, gpu_units)).text
            step.changed, step.evidence = bool(changes.files), [f"release {rid}"]
        # A host whose output lacks the reading (a wrapper that cut it short) is asked again by the gate.
        work.reading = out if gpu_units and f"{MARK}gpus" in out else None
        run.result.changing().release = rid
