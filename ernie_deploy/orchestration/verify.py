"""`verify`: every check on running services, without restarting anything.

Per host two commands: the facts (read-only snapshot), then one probe of all its instances (systemd, this
invocation's journal, nvidia-smi, the process tree, and the HTTP answers the host itself got); then the
pure checks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ernie_deploy.checks.playbook import Expectations
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.instancecheck import api_key, instance_checks, requests_for
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import SnapshotOptions, take
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.render import environment_for_templates, templates_dir
from ernie_deploy.remote import probe


class Verifier:
    def __init__(self, ctx: PlanContext, connector: Connector, options: FleetOptions,
                 progress: Progress | None = None, expectations: Expectations | None = None) -> None:
        self.ctx = ctx
        self.fleet = Fleet(connector, options, progress)
        self.templates = environment_for_templates(templates_dir())
        self.expectations = expectations or Expectations()

    @property
    def interrupted(self) -> bool:
        return self.fleet.interrupted

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        runs = self.fleet.runs(hosts)
        try:
            self.fleet.phase(runs, self._host)
        finally:
            self.fleet.close(runs, lambda run: None)
        return [r.result for r in runs]

    def _host(self, run: HostRun) -> None:
        result = run.result
        snap = take(self.fleet, run, self.ctx, self.templates, SnapshotOptions(render=False))
        if snap is None:
            if result.message.startswith("the plan has errors"):
                result.message = "the plan has errors; fix them and deploy"
            return
        plan = snap.plan
        result.findings = [f for f in plan.findings if f.severity in (Severity.ERROR, Severity.WARNING)]
        assert run.session is not None
        self.fleet.progress(plan.name, "probing instances")
        units = [f"{i.unit}.service" for i in plan.instances]
        requests = [r for i in plan.instances for r in requests_for(plan, i, self.expectations)]
        with self.fleet.step(run, "probe"):
            seen = probe.parse(run.session.run(probe.host_command(units, requests, api_key(plan))).text)
        with self.fleet.step(run, "checks") as step:
            for inst in plan.instances:
                result.checks += instance_checks(plan, inst, seen, self.expectations)
            failed = [c for c in result.checks if c.status == "fail"]
            warned = [c for c in result.checks if c.status == "warn"]
            step.status = "failed" if failed else "ok"
        result.status = Status.FAILED if failed else Status.OK
        warnings = f", {len(warned)} warning(s)" if warned else ""
        result.message = (f"{len(failed)} of {len(result.checks)} checks failed" if failed else
                          f"all {len(result.checks)} checks passed{warnings}")
