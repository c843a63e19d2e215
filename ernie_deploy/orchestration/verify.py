"""`verify`: every check on running services, without restarting anything.

Per host three commands: the facts (read-only snapshot), then one probe of all its instances (systemd, this
invocation's journal, nvidia-smi, the process tree, and the HTTP answers the host itself got), then the pure
checks; then one read of the serving instances' progress (two /metrics readings a window apart, the second only
for an instance with work: orchestration/progress.py), a `progress` check each (docs/progress.md). Under
`--check` (a playbook's check mode starts nothing) it probes nothing and says, per instance, what it would check:
judging services check mode never started would fail every fresh host.

With `bench` (`verify --bench`), each instance whose checks passed is then benched with vLLM's `vllm bench serve`
(the host's inventory workload, one instance after another, orchestration/bench.py): the bench is a check, and so
is each SLO verdict; without SLOs the numbers are reported and nothing is judged. An instance whose checks failed
is not benched (its numbers would say nothing the failed check does not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.checks.progress import HUNG, Thresholds, progress_check
from ernie_deploy.checks.progress import Progress as InstanceProgress
from ernie_deploy.checks.result import CheckResult
from ernie_deploy.orchestration.bench import InstanceBench, bench_check, bench_instance
from ernie_deploy.orchestration.cycle import unit_of
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.instancecheck import api_key, instance_checks, request_id, requests_for
from ernie_deploy.orchestration.progress import host_thresholds, read_serving
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import Snapshot, SnapshotOptions, take
from ernie_deploy.orchestration.steps import StepStatus
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost
from ernie_deploy.planning.bench import BenchSpec, spec_from_plan
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.hostpaths import local_url
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.remote import converge, probe
from ernie_deploy.remote.converge import held_gpus


def drift_checks(snap: Snapshot) -> list[CheckResult]:
    """Units the plan no longer has (a warning; a failure when they hold GPUs the plan needs) and drop-ins
    overriding managed units (a failure: what runs is not what the plan says)."""
    out = []
    for unit in snap.changes.leftover:
        state = snap.facts.units.get(unit)
        held = held_gpus(snap.plan, snap.facts, unit)
        out.append(CheckResult(
            "leftover", "fail" if held else "warn",
            f"{unit} is not in the plan ({state.active_state if state else 'unknown'}"
            + (f", on GPU(s) {', '.join(map(str, held))} the plan needs)" if held else ")"),
            fix="`ernie-deploy deploy --prune` stops and removes it", instance=unit.removesuffix(".service")))
    for path in snap.changes.dropins:
        out.append(CheckResult("drop-in", "fail", f"{path} overrides a managed unit", instance=None,
                               cause="`systemctl edit` or a hand-written drop-in changes what runs",
                               fix="fold the setting into the inventory, then `ernie-deploy deploy --prune`"))
    return out


# What each family of checks judges (instancecheck.py runs them, and orchestration/progress.py reads progress);
# `would_check` names them per instance.
KINDS = ("systemd", "startup_log", "http", "gpus", "progress", "drift")


def would_check(plan: HostPlan, exp: Expectations, kinds: Sequence[str] = KINDS,
                bench: BenchSpec | None = None, th: Thresholds | None = None) -> list[str]:
    """What verify would judge on this host, one line per instance and family (and the bench, with `bench`), said
    without asking the host; `th`: the progress thresholds (the defaults when None)."""
    th = th or Thresholds()
    out = []
    for inst in plan.instances:
        said = {
            "systemd": f"systemd: {inst.unit}.service active (running), not restarted by systemd in the last "
                       f"{plan.tuning.stable_seconds:g}s",
            "startup_log": "start-up log: tensor parallel size " + str(inst.tensor_parallel_size)
                           + (f", max_model_len {inst.max_model_len}" if inst.max_model_len else "")
                           + ", KV cache size, no fatal errors"
                           + "".join(f", expect /{p}/" for p in exp.expect)
                           + "".join(f", forbid /{p}/" for p in exp.forbid),
            "http": f"HTTP on the host: {local_url(inst.host, inst.port)}/health 200, /v1/models lists "
                    f"{inst.served_model_name!r}, one {'streamed ' if exp.stream else ''}completion",
            "gpus": f"GPUs {', '.join(map(str, inst.gpus))}: present, held by its processes only, memory and "
                    "utilisation balanced",
            "progress": "progress: /metrics readable; with requests running, tokens come out within "
                        f"{th.window_s:g}s; a waiting queue does not grow while nothing runs",
        }
        out += [f"{inst.unit}: {said[k]}" for k in kinds if k in said]
        if bench is not None:
            slos = [v.replace("_", " ") for v, limit in bench.slo.to_json().items() if limit is not None]
            out.append(f"{inst.unit}: bench: vllm bench serve, {bench.workload.num_prompts} requests, once its checks "
                       "pass; " + (f"SLOs: {', '.join(slos)}" if slos else "no SLOs set: numbers only"))
    if "drift" in kinds:
        out.append("host: no unit outside the plan on its GPUs, no drop-in overriding a managed unit")
    return out


def active(snap: Snapshot, inst: InstancePlan) -> bool:
    """systemd runs the instance's unit, as the facts say: only then has it /metrics worth reading."""
    state = snap.facts.units.get(unit_of(inst))
    return state is not None and state.active_state == "active"


def not_sent(completion: CheckResult, progress: InstanceProgress) -> CheckResult:
    """The smoke completion's check for an instance whose engine makes no progress: failed without asking."""
    return CheckResult(completion.name, "fail", f"smoke completion not sent: the engine is {progress.state} (a "
                       "request would wait out its timeout; the progress check has the readings)",
                       instance=completion.instance, cause="requests are accepted but no token is generated",
                       fix=progress.fix)


class Verifier:
    def __init__(self, ctx: PlanContext, connector: Connector, options: FleetOptions,
                 progress: Progress | None = None, expectations: Expectations | None = None,
                 fleet: Fleet | None = None, check: bool = False, kinds: Sequence[str] = KINDS,
                 bench: Mapping[str, Any] | None = None, save_dir: Path | None = None) -> None:
        """`fleet`: run on this one (a playbook's task) instead of a new one. `check`: say what it would check
        (of `kinds`) instead of probing. `bench`: bench each instance whose checks passed, with these workload
        overrides (settings.BENCH_TYPES names; empty: the inventory's); its raw results go to `save_dir`."""
        self.ctx, self.check, self.kinds = ctx, check, kinds
        self.bench = None if bench is None else dict(bench)
        self.save_dir = save_dir
        self.reports: dict[str, list[InstanceBench]] = {}  # with `bench`: host → its instances' benches
        self.fleet = fleet or Fleet(connector, options, progress)
        self.templates = unit_environment()
        self.expectations = expectations or Expectations()

    @property
    def stopped_by(self) -> int | None:
        """The signal that stopped the run (Ctrl-C: SIGINT), or None."""
        return self.fleet.signal

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        return [r.result for r in self.fleet.run(hosts, [self._host])]

    def _host(self, run: HostRun[None]) -> None:
        result = run.result
        th = host_thresholds(run)
        if th is None:
            return
        snap = take(self.fleet, run, self.ctx, self.templates, SnapshotOptions(render=False))
        if snap is None:
            if result.message.startswith("the plan has errors"):
                result.message = "the plan has errors; fix them and deploy"
            return
        plan = snap.plan
        result.findings = [f for f in plan.findings if f.severity in (Severity.ERROR, Severity.WARNING)]
        if self.check:
            with self.fleet.step(run, "checks") as step:
                step.status = StepStatus.WOULD_CHECK
                spec = None if self.bench is None else spec_from_plan(plan, self.bench)
                result.evidence = would_check(plan, self.expectations, self.kinds, spec, th)
            result.message = (f"check mode: would run {len(result.evidence)} group(s) of checks on "
                              f"{len(plan.instances)} instance(s)")
            return
        assert run.session is not None
        # Progress is read before the probe: a stalled engine would hold the smoke completion for its whole
        # 60 s timeout, so such an instance is not sent one (its progress check carries the readings).
        found = read_serving(self.fleet, run, plan, [i for i in plan.instances if active(snap, i)], th)
        hung = {u for u, p in found.items() if p.state in HUNG}
        self.fleet.progress(plan.name, "probing instances")
        units = [f"{i.unit}.service" for i in plan.instances]
        requests = [r for i in plan.instances for r in requests_for(plan, i, self.expectations)
                    if not (i.unit in hung and r.id == request_id(i, "completion"))]
        with self.fleet.step(run, "probe"):
            seen = probe.parse(run.session.run(probe.host_command(units, requests, api_key(plan))).text)
        with self.fleet.step(run, "checks") as step:
            for inst in plan.instances:
                story = converge.death_story(f"{inst.unit}.service", snap.facts,
                                             f"ernie-deploy deploy -i INV --limit {plan.name}")
                checks = instance_checks(plan, inst, seen, self.expectations, story)
                result.checks += [not_sent(c, found[inst.unit]) if inst.unit in hung and
                                  c.name == "http_completion" else c for c in checks]
            result.checks += drift_checks(snap)
            step.status = StepStatus.FAILED if any(c.status == "fail" for c in result.checks) else StepStatus.OK
        self._progress(run, plan, found)
        if self.bench is not None:
            self._bench(run, plan)
        failed = [c for c in result.checks if c.status == "fail"]
        warned = [c for c in result.checks if c.status == "warn"]
        result.status = Status.FAILED if failed else Status.OK
        warnings = f", {len(warned)} warning(s)" if warned else ""
        result.message = (f"{len(failed)} of {len(result.checks)} checks failed" if failed else
                          f"all {len(result.checks)} checks passed{warnings}") + tp_verified(plan, result.checks)

    def _progress(self, run: HostRun[None], plan: HostPlan, found: Mapping[str, InstanceProgress]) -> None:
        """The progress check of each instance that serves (/health 200); one that does not already fails its
        HTTP check, and its /metrics reading says nothing more."""
        result = run.result
        healthy = {c.instance for c in result.checks if c.name == "http_health" and c.status == "pass"}
        for inst in plan.instances:
            if inst.unit in found and inst.unit in healthy:
                result.checks.append(progress_check(inst.unit, found[inst.unit]))
            else:
                result.evidence.append(f"{inst.unit}: progress not read: it does not serve (its checks say why)")

    def _bench(self, run: HostRun[None], plan: HostPlan) -> None:
        """Bench each instance whose checks passed, one after another; the bench and its verdicts become checks."""
        result = run.result
        spec = spec_from_plan(plan, self.bench)
        benches = self.reports.setdefault(plan.name, [])
        for inst in plan.instances:
            if self.fleet.abort.is_set():
                break
            if any(c.status == "fail" and c.instance == inst.unit for c in result.checks):
                result.evidence.append(f"{inst.unit}: not benched: its checks failed")
                continue
            made = bench_instance(self.fleet, run, plan, inst, spec, self.save_dir)
            benches.append(made)
            result.checks += [bench_check(made), *(v.check(inst.unit) for v in made.verdicts)]


def tp_verified(plan: HostPlan, checks: Sequence[CheckResult]) -> str:
    """What operators run verify for, on its one line: each instance's tensor parallel size as vLLM's own start-up
    lines state it (the tensor_parallel check): `; TP ernie-vllm-0 2 ✓, ernie-vllm-1 2 ✓`, `2 ?` where no line
    states it, `✗` where vLLM runs another size (that check's summary says which)."""
    verdicts = {c.instance: c.status for c in checks if c.name == "tensor_parallel"}
    marks = {"pass": "✓", "warn": "?", "fail": "✗"}
    told = [f"{i.unit} {i.tensor_parallel_size} {marks[verdicts[i.unit]]}" if verdicts[i.unit] != "fail"
            else f"{i.unit} ✗" for i in plan.instances if i.unit in verdicts]
    return f"; TP {', '.join(told)}" if told else ""
