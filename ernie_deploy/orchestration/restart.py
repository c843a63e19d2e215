"""Restart and rollback: day-two rollouts over running instances, batch by batch (rollout.py), each instance
through the restart cycle (cycle.py).

* restart: the same files, a new process (after a driver or model-file update, or to clear a wedged or
  crash-looping instance). A host whose files differ from the plan is refused: deploy rolls those out.
* rollback: put back a release kept on the host (the one before the current, or --to ID), then cycle its
  instances and verify them against what the release's unit files run. A failed one goes back to what ran
  before the rollback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import audit
from ernie_deploy.orchestration.balancers import BalancerControl
from ernie_deploy.orchestration.cycle import (
    CycleOptions,
    HostCycle,
    Work,
    put_back,
    released_instances,
    stray_processes,
    unit_of,
)
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.rollout import Report, RolloutOptions, drive
from ernie_deploy.orchestration.snapshot import Snapshot, SnapshotOptions, down, take
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost
from ernie_deploy.planning.hostpaths import RELEASES_DIR
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.remote import converge, lock, releases


@dataclass(frozen=True)
class RestartOptions:
    mode: str = "restart"  # restart | rollback
    instance: str | None = None  # one instance: its index, unit name or unit
    to: str | None = None  # rollback: the release id (default: the one before the current)
    check: bool = False
    forks: int = 5
    lock_wait: float = 0.0
    known_hosts: tuple[str, ...] = ()
    command: str = "ernie-deploy restart"
    templates: Path | None = None  # the templates deploy used: a restart compares the host's files with them
    cycle: CycleOptions = field(default_factory=CycleOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)


@dataclass
class Scoped:
    """A host's snapshot and the instances in scope of the restart or rollback (--instance)."""

    snapshot: Snapshot
    scope: list[InstancePlan]


def select(plan: HostPlan, instance: str | None) -> list[InstancePlan]:
    """The host's instances in scope; --instance K names one by index (1), unit name (ernie-vllm-1) or unit."""
    if instance is None:
        return list(plan.instances)
    wanted = instance.removesuffix(".service")
    found = [i for i in plan.instances if wanted in (str(i.index), i.unit)]
    if not found:
        names = ", ".join(f"{i.index} ({i.unit})" for i in plan.instances)
        raise DeployError(f"no instance {instance!r} on this host", where=plan.name,
                          hint=f"--instance takes an index or unit name of the plan: {names}")
    return found


class Restarter:
    def __init__(self, ctx: PlanContext, connector: Connector, options: RestartOptions,
                 progress: Progress | None = None, expectations: Expectations | None = None,
                 fleet: Fleet | None = None) -> None:
        """`fleet`: run on this one (a playbook's task) instead of one of the options' own."""
        self.ctx = ctx
        self.options = options
        self.fleet = fleet or Fleet(connector, FleetOptions(options.forks, False, options.known_hosts), progress)
        self.templates = unit_environment(options.templates)
        self.lock = lock.LockInfo.mine(options.command)
        self.expectations = expectations or Expectations()
        self.report = Report()

    @property
    def stopped_by(self) -> int | None:
        return self.fleet.signal

    @property
    def balancers(self) -> BalancerControl | None:
        return self.options.cycle.balancers

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        return drive(self, hosts, self.options.rollout)

    def snapshot(self, run: HostRun[Scoped]) -> None:
        opts = SnapshotOptions(lock=None if self.options.check else self.lock, lock_wait=self.options.lock_wait,
                               take_over_stale=self.options.rollout.resume)
        snap = take(self.fleet, run, self.ctx, self.templates, opts)
        if snap is not None:
            run.state = Scoped(snap, select(snap.plan, self.options.instance))

    def disrupts(self, run: HostRun[Scoped]) -> bool:
        if run.state is None:
            return False
        units = run.state.snapshot.facts.units
        return any(unit_of(i) in units and units[unit_of(i)].active_state in converge.RUNNING for i in run.state.scope)

    def strays(self, run: HostRun[Scoped]) -> list[tuple[str, int]]:
        if run.state is None or run.session is None:
            return []
        return stray_processes(run.session, run.state.snapshot.plan, run.state.scope)

    def put_back(self, run: HostRun[Scoped]) -> None:
        if run.state is not None:
            snap = run.state.snapshot
            stable = snap.plan.tuning.stable_seconds
            put_back(self.fleet, run, snap.plan,
                     lambda unit: converge.serving_problem(unit, snap.facts, stable) is None,
                     self.report.rotation, self.options.cycle)

    def problems(self, run: HostRun[Scoped]) -> list[str]:
        if run.state is None:
            return []
        return down(run.host.name, run.state.snapshot, [unit_of(i) for i in run.state.scope], installed_only=False)

    def _audit(self, run: HostRun[Scoped], action: str) -> dict[str, Any]:
        return audit.record(self.lock, run.host.name, action)

    def _work(self, run: HostRun[Scoped], snap: Snapshot, insts: list[InstancePlan], batch: int) -> Work:
        facts = snap.facts
        stable = snap.plan.tuning.stable_seconds
        running = {unit_of(i) for i in insts if facts.units.get(unit_of(i)) is not None
                   and facts.units[unit_of(i)].active_state in converge.RUNNING}
        serving = {u for u in running if converge.serving_problem(u, facts, stable) is None}
        return Work(snap.plan, insts, running, serving, batch=batch)

    def change(self, run: HostRun[Scoped], batch: int) -> None:
        if run.state is None:
            return
        if self.options.mode == "rollback":
            self._rollback(run, run.state, batch)
        else:
            self._restart(run, run.state, batch)

    def _restart(self, run: HostRun[Scoped], scoped: Scoped, batch: int) -> None:
        result, snap, scope = run.result, scoped.snapshot, scoped.scope
        units = [unit_of(i) for i in scope]
        missing = [u for u in units if u not in snap.facts.units]
        if missing:
            result.fail(Status.FAILED, f"not deployed: {', '.join(missing)}; nothing was restarted",
                        "ernie-deploy deploy installs and starts them")
            return
        stale = sorted({c.path for c in snap.changes.files
                        if any(c.path.endswith((f"/{u}", f"/{u.removesuffix('.service')}.env")) for u in units)})
        if stale:
            result.fail(Status.FAILED, f"files differ from the plan: {', '.join(stale)}; nothing was restarted",
                        "a restart would not apply them: roll them out with ernie-deploy deploy --serial 1")
            return
        work = self._work(run, snap, scope, batch)
        work.revertible = False
        done = result.changing()
        done.restarted = units
        done.reasons = {u: "restart requested" for u in units}
        how = "one at a time" if len(units) > 1 and not self.options.cycle.parallel_instances else ""
        if self.options.check:
            result.status, result.message = Status.CHANGED, f"would restart {', '.join(units)} {how}".rstrip()
            return
        result.status = Status.CHANGED
        if HostCycle(self.fleet, run, work, self.options.cycle, self.expectations, self.report.timeline,
                     lambda action: self._audit(run, action), self.report.rotation).go():
            result.message = f"restarted {', '.join(units)}; every instance verified"

    def _diffs(self, run: HostRun[Scoped], target: releases.Release, units: tuple[str, ...]) -> list[str]:
        """What restoring `target` for `units` would change, file by file, as `deploy --check --diff` shows it
        (env files redacted): the host's file against the release's copy, read in one round trip."""
        assert run.session is not None
        paths = list(releases.restoring(target, units).paths)
        kept = [f"{RELEASES_DIR}/{target.id}{p}" for p in paths]
        text = converge.parse_read(run.session.run(converge.read_command(paths + kept)).text)
        return [converge.unified_diff(p, text.get(p), text.get(k, ""), p.endswith(".env"),
                                      new_label=f"release {target.id}")
                for p, k in zip(paths, kept, strict=True) if text.get(p) != text.get(k)]

    def _rollback(self, run: HostRun[Scoped], scoped: Scoped, batch: int) -> None:
        assert run.session is not None
        result, snap, scope = run.result, scoped.snapshot, scoped.scope
        files = snap.facts.files
        kept = releases.parse_list(run.session.run(releases.list_command()).text)
        result.evidence += kept.notes()
        now = releases.current(kept, files)
        if self.options.to:
            target = next((r for r in kept if r.id == self.options.to), None)
            if target is None:
                result.fail(Status.FAILED, f"release {self.options.to} is not kept on this host",
                            "ernie-deploy releases -i INV --limit HOST lists the kept ones: "
                            + (", ".join(r.id for r in kept) or "none"))
                return
        elif now is None:
            result.fail(Status.FAILED, "the installed files match no kept release as a whole (an earlier rollback "
                        "of one instance, or hand edits), so 'the one before' is not defined",
                        "name the release: --to ID (ernie-deploy releases -i INV --limit HOST lists them)")
            return
        else:
            target = releases.previous(kept, files)
            if target is None:
                result.fail(Status.FAILED, "no earlier release is kept on this host: nothing to roll back to",
                            "ernie-deploy releases -i INV --limit HOST lists what is kept")
                return
        if target.failed is not None and not self.options.rollout.force:
            result.fail(Status.FAILED, f"release {target.id} {target.failed.describe()}; nothing was changed",
                        "roll back to a release that ran (ernie-deploy releases -i INV --limit HOST marks the "
                        "failed ones, then --to ID), or add --force to go back to it anyway")
            return
        insts = [i for i in scope if releases.has_unit(target, unit_of(i))]
        units = tuple(unit_of(i) for i in insts)
        same = all(target.files.get(p) == files.get(p) for p in target.files
                   if any(p.endswith((f"/{u}", f"/{u.removesuffix('.service')}.env")) for u in units))
        if not insts or same:
            result.message = f"already at release {target.id}: nothing to roll back" if insts else \
                f"release {target.id} has none of the instances in scope"
            return
        done = result.changing()
        done.release, done.restarted = target.id, list(units)
        done.reasons = {u: f"rollback to {target.id}" + (f" (from {now.id})" if now else "") for u in units}
        result.status = Status.CHANGED
        if target.failed is not None:
            result.evidence.append(f"--force: going back to release {target.id}, which {target.failed.describe()}")
        if self.options.check:
            done.diffs = self._diffs(run, target, units)
            result.message = f"would restore release {target.id} for {', '.join(units)} and restart them"
            return
        with self.fleet.step(run, "restore") as step:
            run.session.run(releases.restore_command(target, units, {**self._audit(run, "rollback"),
                                                                      "release": target.id}))
            step.changed, step.evidence = True, [f"release {target.id}"]
        back = released_instances(run.session, target, snap.plan, insts)
        work = self._work(run, snap, back, batch)
        work.activation = converge.Changes(reload=True)
        work.undo_to = releases.running_releases(kept, files, list(units))
        work.whole = [f"{unit_of(i)} moves to GPU(s) {','.join(map(str, i.gpus))}" for i in back
                      if unit_of(i) in work.running and tuple(snap.facts.unit_gpus.get(unit_of(i), ())) != i.gpus]
        if HostCycle(self.fleet, run, work, self.options.cycle, self.expectations, self.report.timeline,
                     lambda action: self._audit(run, action), self.report.rotation).go():
            result.message = f"rolled back to release {target.id}; every instance verified"
