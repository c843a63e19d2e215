"""Deploy: converge hosts to their plans, phase by phase across hosts.

1. snapshot every host (connect, lock + facts in one command, plan, render, changes);
2. change each host: show diffs, stage (files in place, a release recorded, nothing restarted), activate
   (daemon-reload once, restart exactly the changed units), then watch every (re)started instance until
   ready and check it; facts are re-read first when the snapshot has grown old;
3. close: release every lock and close every session, also after a failure or Ctrl-C.

A host's failure never stops the others unless `any_errors_fatal` is set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ernie_deploy.checks.playbook import Expectations
from ernie_deploy.checks.result import CheckResult
from ernie_deploy.orchestration import readiness
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.instancecheck import api_key, instance_checks, requests_for
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import Snapshot, SnapshotOptions, refresh, release_lock, take
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost, Transport
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import InstancePlan
from ernie_deploy.planning.render import environment_for_templates, templates_dir
from ernie_deploy.remote import converge, lock, probe
from ernie_deploy.remote.ssh import Failure, RemoteError


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


class Runner:
    """One deploy (or check) run over many hosts."""

    def __init__(self, ctx: PlanContext, connector: Connector, options: Options,
                 progress: Progress | None = None, expectations: Expectations | None = None) -> None:
        self.ctx = ctx
        self.options = options
        self.fleet = Fleet(connector, FleetOptions(options.forks, options.any_errors_fatal, options.known_hosts),
                           progress)
        self.templates = environment_for_templates(templates_dir(options.templates))
        self.lock = lock.LockInfo.mine(options.command)
        self.expectations = expectations or Expectations()

    @property
    def stopped_by(self) -> int | None:
        """The signal that stopped the run (Ctrl-C: SIGINT), or None."""
        return self.fleet.signal

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        opts = SnapshotOptions(lock=None if self.options.check else self.lock, lock_wait=self.options.lock_wait,
                               prune=self.options.prune)
        runs = self.fleet.run(hosts, [lambda run: self._snapshot(run, opts), self._change], release_lock)
        return [r.result for r in runs]

    def _snapshot(self, run: HostRun, opts: SnapshotOptions) -> None:
        snap = take(self.fleet, run, self.ctx, self.templates, opts)
        if snap is not None:
            run.data["snapshot"] = snap

    def _change(self, run: HostRun) -> None:
        snap: Snapshot | None = run.data.get("snapshot")
        if snap is None:
            return
        opts, result, session = self.options, run.result, run.session
        assert session is not None
        if not opts.check and time.monotonic() - snap.taken > opts.recheck_after:
            snap = run.data["snapshot"] = refresh(self.fleet, run, snap, opts.prune)
        changes = snap.changes
        result.changed_files = [c.path for c in changes.files]
        result.restarted, result.started = list(changes.restart), list(changes.start)
        result.enabled, result.pruned, result.reasons = list(changes.enable), list(changes.prune), changes.reasons
        result.leftover, result.dropins = list(changes.leftover), list(changes.dropins)
        if opts.diff and (changes.files or changes.dropins):
            result.diffs = self._diffs(session, snap)
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
        if opts.check:
            result.message = "would change (check mode: nothing was touched)" + leftover
            return
        if self.fleet.abort.is_set():
            result.fail(Status.SKIPPED, "skipped before changing anything: run aborted")
            return
        launched = self._stage_and_activate(run, snap)
        started = [i for i in snap.plan.instances if f"{i.unit}.service" in changes.units]
        if started and not self._verify_started(run, snap, started, launched):
            return
        result.message = ("changed; every (re)started instance verified" if started else "changed") + leftover

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

    def _audit(self, run: HostRun, action: str, changes: converge.Changes) -> dict[str, object]:
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "user": self.lock.user,
                "controller": self.lock.controller, "command": self.options.command, "host": run.host.name,
                "action": action,
                "files": [{"path": c.path, "old_sha256": c.old_sha256, "new_sha256": c.new_sha256}
                          for c in changes.files],
                "restart": list(changes.restart), "start": list(changes.start), "prune": list(changes.prune)}

    def _stage_and_activate(self, run: HostRun, snap: Snapshot) -> dict[str, converge.Started]:
        """Stage the files (recording a release), then activate; the new run of each (re)started unit."""
        assert run.session is not None
        changes, name = snap.changes, run.host.name
        if changes.files or changes.units:
            self.fleet.progress(name, f"staging {len(changes.files)} file(s)")
            audit = self._audit(run, "stage", changes)
            rid = converge.release_id(snap.files, time.time())
            release = {**audit, "id": rid, "files": {f.path: f.sha256 for f in snap.files},
                       "changed": [c.path for c in changes.files]}
            keep = max(1, int(snap.plan.settings["keep_releases"].value))
            with self.fleet.step(run, "stage") as step:
                run.session.run(converge.stage_command(snap.files, changes, audit, release, keep))
                step.changed, step.evidence = bool(changes.files), [f"release {rid}"]
            run.result.release = rid
        self.fleet.progress(name, "activating " + (" ".join(changes.units) or "units"))
        with self.fleet.step(run, "activate") as step:
            out = run.session.run(converge.activate_command(changes, self._audit(run, "activate", changes))).text
            step.changed = True
            launched = converge.started_units(out)
            missing = [u for u in changes.units if u not in launched]
            if missing:
                # Nothing can be verified without knowing which run to watch: never call it ok.
                raise RemoteError(Failure.COMMAND, "activate printed no restart marker for "
                                  f"{', '.join(missing)}, so the (re)started units could not be verified", where=name,
                                  hint="check that the host's shell runs the activate script unchanged "
                                       "(sudo wrappers that swallow output?), then deploy again")
            for unit in converge.killed_units(out):
                run.result.checks.append(CheckResult(
                    "stop", "warn", f"{unit}: the old process did not stop within TimeoutStopSec and was killed "
                    "(SIGKILL): requests still in flight were cut", instance=unit.removesuffix(".service"),
                    fix="raise vllm_drain_timeout if requests need longer to finish"))
        return launched

    def _verify_started(self, run: HostRun, snap: Snapshot, started: list[InstancePlan],
                        launched: dict[str, converge.Started]) -> bool:
        """Readiness watch, then every instance check, for each (re)started instance. False on failure."""
        assert run.session is not None
        plan, result = snap.plan, run.result
        budget = self.options.health_timeout or float(plan.settings["startup_budget"].value)
        stable = self.options.stable if self.options.stable is not None else \
            float(plan.settings["stable_seconds"].value)
        for inst in started:
            self.fleet.progress(plan.name, f"waiting for {inst.unit} to become ready")
            with self.fleet.step(run, f"ready {inst.unit}") as step:
                ready = readiness.watch(run.session, plan, inst, started=launched[f"{inst.unit}.service"],
                                        budget=budget, exp=self.expectations, abort=self.fleet.abort, stable=stable,
                                        poll=self.options.poll)
                step.evidence = [ready.summary]
                if ready.status != "ready":
                    step.status = "failed"
                    result.fail(Status.FAILED, ready.summary, " · ".join(x for x in (ready.cause, ready.fix) if x)
                                or None)
                    result.evidence = ready.evidence
                    return False
        self.fleet.progress(plan.name, "checking the started instances")
        units = [f"{i.unit}.service" for i in started]
        requests = [r for i in started for r in requests_for(plan, i, self.expectations)]
        with self.fleet.step(run, "checks") as step:
            seen = probe.parse(run.session.run(probe.host_command(units, requests, api_key(plan))).text)
            for inst in started:
                result.checks += instance_checks(plan, inst, seen, self.expectations)
            failed = [c for c in result.checks if c.status == "fail"]
            if failed:
                step.status = "failed"
                result.fail(Status.FAILED, f"{len(failed)} check(s) failed after the restart: "
                            + "; ".join(c.summary for c in failed))
                return False
        return True
