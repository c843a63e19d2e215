"""`verify`: every check on running services, without restarting anything.

Per host: one command for facts, one for the state of all its instances (systemd, this invocation's
journal, nvidia-smi, the process tree); HTTP from here; then the pure checks.
"""

from __future__ import annotations

from ernie_deploy.orchestration.deploy import Runner, Session, discovered, target_for
from ernie_deploy.orchestration.instancecheck import instance_checks
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.plan import HostLike, plan_host
from ernie_deploy.remote import probe
from ernie_deploy.remote.facts import gather_script, parse_facts


class Verifier(Runner):
    def _host(self, host: HostLike, result: HostResult) -> None:
        pre = plan_host(host, self.ctx)
        if any(f.code == "input" for f in pre.errors):
            result.status, result.findings = Status.FAILED, pre.errors
            result.message = "the plan has errors; nothing to verify against"
            return
        self.progress(host.name, "connecting")
        session: Session = self.connect(target_for(host, self.options.known_hosts))
        try:
            self.progress(host.name, "gathering facts")
            facts = parse_facts(session.run(gather_script(pre.model_path, pre.bin), label="gather facts").text)
            plan = plan_host(host, self.ctx, discovered(facts))
            result.findings = [f for f in plan.findings if f.severity in (Severity.ERROR, Severity.WARNING)]
            if not plan.ok:
                result.status, result.message = Status.FAILED, "the plan has errors; fix them and deploy"
                return
            self.progress(host.name, "probing instances")
            units = [f"{i.unit}.service" for i in plan.instances]
            states, other = probe.parse(session.run(probe.host_script(units), label="probe instances").text)
            for inst in plan.instances:
                self.progress(host.name, f"checking {inst.unit}")
                result.checks += instance_checks(plan, inst, states.get(f"{inst.unit}.service", probe.UnitState()),
                                                 other.get("gpus", ""), other.get("apps", ""), other.get("ps", ""),
                                                 self.expectations)
            failed = [c for c in result.checks if c.status == "fail"]
            warned = [c for c in result.checks if c.status == "warn"]
            result.status = Status.FAILED if failed else Status.OK
            warnings = f", {len(warned)} warning(s)" if warned else ""
            result.message = (f"{len(failed)} of {len(result.checks)} checks failed" if failed else
                              f"all {len(result.checks)} checks passed{warnings}")
        finally:
            result.commands, result.command_log = session.commands, list(session.history)
            session.close()
