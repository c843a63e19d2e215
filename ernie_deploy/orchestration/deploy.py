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
from ernie_deploy.orchestration import readiness
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.instancecheck import api_key, instance_checks, requests_for
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import Snapshot, SnapshotOptions, refresh, release_lock, take
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost
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
    stable: float = 3.0  # seconds an instance must stay healthy after it first answered
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
    def interrupted(self) -> bool:
        return self.fleet.interrupted

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        runs = self.fleet.runs(hosts)
        opts = SnapshotOptions(lock=None if self.options.check else self.lock, lock_wait=self.options.lock_wait,
                               prune=self.options.prune)
        try:
            self.fleet.phase(runs, lambda run: self._snapshot(run, opts))
            self.fleet.phase(runs, self._change)
        finally:
            self.fleet.close(runs, release_lock)
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
        if opts.diff and changes.files:
            existing = [c.path for c in changes.files if c.old_sha256]
            old = converge.parse_read(session.run(converge.read_command(existing)).text) if existing else {}
            by_path = {f.path: f for f in snap.files}
            result.diffs = [converge.unified_diff(c.path, old.get(c.path) if c.old_sha256 else None,
                                                  by_path[c.path].content, c.secret) for c in changes.files]
        if changes.empty:
            result.status, result.message = Status.OK, "nothing to change: units and env files match, all running"
            return
        result.status = Status.CHANGED
        if opts.check:
            result.message = "would change (check mode: nothing was touched)"
            return
        if self.fleet.abort.is_set():
            result.fail(Status.SKIPPED, "skipped before changing anything: run aborted")
            return
        since = self._stage_and_activate(run, snap)
        started = [i for i in snap.plan.instances if f"{i.unit}.service" in changes.units]
        if started and not self._verify_started(run, snap, started, since):
            return
        result.message = "changed; every (re)started instance verified" if started else "changed"

    def _audit(self, run: HostRun, action: str, changes: converge.Changes) -> dict[str, object]:
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "user": self.lock.user,
                "controller": self.lock.controller, "command": self.options.command, "host": run.host.name,
                "action": action,
                "files": [{"path": c.path, "old_sha256": c.old_sha256, "new_sha256": c.new_sha256}
                          for c in changes.files],
                "restart": list(changes.restart), "start": list(changes.start), "prune": list(changes.prune)}

    def _stage_and_activate(self, run: HostRun, snap: Snapshot) -> str | None:
        """Stage the files (recording a release), then activate; the journal start of the (re)started units."""
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
            since = converge.restart_marker(out)
            if changes.units and since is None:
                # Nothing can be verified without knowing where this start's journal begins: never call it ok.
                raise RemoteError(Failure.COMMAND, "activate printed no restart marker, so the (re)started units "
                                  f"({', '.join(changes.units)}) could not be verified", where=name,
                                  hint="check that the host's shell runs the activate script unchanged "
                                       "(sudo wrappers that swallow output?), then deploy again")
        return since

    def _verify_started(self, run: HostRun, snap: Snapshot, started: list[InstancePlan],
                        since: str | None) -> bool:
        """Readiness watch, then every instance check, for each (re)started instance. False on failure."""
        assert run.session is not None and since is not None
        plan, result = snap.plan, run.result
        budget = self.options.health_timeout or float(plan.settings["startup_budget"].value)
        for inst in started:
            self.fleet.progress(plan.name, f"waiting for {inst.unit} to become ready")
            with self.fleet.step(run, f"ready {inst.unit}") as step:
                ready = readiness.watch(run.session, plan, inst, since=since, budget=budget, exp=self.expectations,
                                        abort=self.fleet.abort, stable=self.options.stable, poll=self.options.poll)
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
