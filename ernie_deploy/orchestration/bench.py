"""`bench`: vLLM's own `vllm bench serve` against each instance, on its host, judged against the SLOs.

Per host: the facts and the plan (as verify takes them), then one bench per instance, one after another: the
instances of a host share its CPUs (the bench client's tokenizer and event loop run there too), its memory
bandwidth and, with share_gpus, its GPUs, so two benches at once would measure each other. Different hosts share
nothing and run in parallel (--forks). Each instance's raw result file is saved on this machine as soon as it
arrives, so an interrupted run keeps what finished. Nothing on the host changes; the bench's requests go straight
to the instance (a balancer in front keeps sending it traffic too, which the numbers then include).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.instancecheck import api_key
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import SnapshotOptions, take
from ernie_deploy.orchestration.steps import StepStatus
from ernie_deploy.orchestration.transport import RemoteHost
from ernie_deploy.planning.bench import (
    BenchResult,
    BenchSpec,
    Verdict,
    bench_error,
    fits,
    instance_argv,
    judge,
    parse_result,
    partial_result,
    spec_from_plan,
)
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.hostpaths import local_url
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.planning.settings import BENCH_TYPES
from ernie_deploy.remote.bench import RESULT_NAME, Bench, BenchRun, bench_command, parse


def default_save_dir() -> Path:
    """Where raw results go without --save: $XDG_STATE_HOME/ernie-deploy/bench (~/.local/state/... unset)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ernie-deploy" / "bench"


# An instance's outcome: "ok" (finished, every SLO met or none set), "slo-failed", "failed" (no result),
# "timed-out" (stopped at its bound, partial numbers), "down" (not benched), "error" (bad workload, host problem).
OK = "ok"


@dataclass
class InstanceBench:
    unit: str
    served: str
    port: int
    status: str
    message: str
    spec: BenchSpec
    result: BenchResult | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    raw: dict[str, Any] | None = None  # vLLM's saved result, as it wrote it
    saved: str | None = None  # where the raw result was saved on this machine
    argv: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_json(self) -> dict[str, Any]:
        return {"unit": f"{self.unit}.service", "served_model_name": self.served, "port": self.port,
                "status": self.status, "ok": self.ok, "message": self.message,
                "workload": self.spec.workload.to_json(), "slo": self.spec.slo.to_json(),
                "result": self.result.to_json() if self.result else None,
                "verdicts": [v.to_json() for v in self.verdicts], "saved": self.saved, "argv": list(self.argv),
                "raw": self.raw}


def outcome(seen: BenchRun, spec: BenchSpec, inst: InstancePlan, where: str) -> InstanceBench:
    """One instance's bench judged from what its host reported."""
    made = InstanceBench(inst.unit, inst.served_model_name, inst.port, "error", "", spec)
    url = f"{local_url(inst.host, inst.port)}/health"
    if not seen.reached:
        made.message = f"the bench did not run: {seen.error or 'the host printed nothing'}"
        return made
    if seen.health != 200:
        why = f"answered {seen.health}" if seen.health is not None else f"did not answer ({seen.health_error})"
        made.status, made.message = "down", f"{inst.unit} is down: {url} {why}; not benched"
        return made
    if seen.timed_out:
        made.result = partial_result(seen.before, seen.after, inst.served_model_name, seen.seconds)
        made.status = "timed-out"
        done = (f"{made.result.completed} request(s) finished, {made.result.output_throughput:.1f} tok/s"
                if made.result else "vLLM's counters could not be read, nothing measured")
        made.message = (f"stopped at its time bound ({spec.workload.timeout:g}s) before its "
                        f"{spec.workload.num_prompts} requests finished: {done} (partial)")
        made.verdicts = judge(made.result, spec.slo, "not measured: the bench timed out")
        return made
    if seen.result is None:
        made.status = "failed"
        ended = "did not run" if seen.exit_code is None else f"exited {seen.exit_code}"
        made.message = f"vllm bench serve {ended} without a result: {seen.error or bench_error(seen.tail)}"
        made.verdicts = judge(None, spec.slo, "not measured: the bench failed")
        return made
    made.result, made.raw = parse_result(seen.result, where)
    made.verdicts = judge(made.result, spec.slo)
    failed = [v for v in made.verdicts if not v.ok]
    if not made.result.completed:
        made.status = "failed"
        made.message = f"no request succeeded ({made.result.failed or 0} failed): {bench_error(seen.tail)}"
    elif failed:
        made.status, made.message = "slo-failed", f"{len(failed)} of {len(made.verdicts)} SLO(s) not met"
    else:
        made.status = OK
        made.message = f"{len(made.verdicts)} SLO(s) met" if made.verdicts else "measured (no SLOs set)"
    return made


class BenchRunner:
    def __init__(self, ctx: PlanContext, fleet: Fleet, *, overrides: Mapping[str, Any] | None = None,
                 instance: str | None = None, save_dir: Path | None = None) -> None:
        """`overrides`: workload settings of this run (names as settings.BENCH_TYPES); `instance`: one instance
        per host (--instance); `save_dir`: where raw results go (default_save_dir())."""
        self.ctx, self.fleet = ctx, fleet
        self.overrides = dict(overrides or {})
        self.instance = instance
        self.save_dir = save_dir or default_save_dir()
        self.templates = unit_environment()
        self.reports: dict[str, list[InstanceBench]] = {}

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        return [r.result for r in self.fleet.run(hosts, [self._host])]

    def _host(self, run: HostRun[None]) -> None:
        # Imported here: restart imports cycle, whose SLO gate benches through this module.
        from ernie_deploy.orchestration.restart import select
        result = run.result
        snap = take(self.fleet, run, self.ctx, self.templates, SnapshotOptions(render=False))
        if snap is None:
            return
        plan = snap.plan
        result.findings = [f for f in plan.findings if f.severity in (Severity.ERROR, Severity.WARNING)]
        spec = spec_from_plan(plan, self.overrides)
        benches = self.reports.setdefault(plan.name, [])
        for inst in select(plan, self.instance):
            if self.fleet.abort.is_set():
                break
            benches.append(bench_instance(self.fleet, run, plan, inst, spec, self.save_dir))
        result.checks = [v.check(b.unit) for b in benches for v in b.verdicts]
        bad = [b for b in benches if not b.ok]
        if bad or (len(benches) < len(plan.instances) and self.instance is None):
            result.status = Status.FAILED
            result.message = "; ".join(f"{b.unit}: {b.status}" for b in bad) or "interrupted"
        else:
            result.message = f"{len(benches)} instance(s) benched, every SLO met"



def bench_instance(fleet: Fleet, run: HostRun[Any], plan: HostPlan, inst: InstancePlan, spec: BenchSpec,
                   save_dir: Path | None = None) -> InstanceBench:
    """One instance benched over its host's session (one step, `bench UNIT`), judged, its raw result saved under
    `save_dir` (default_save_dir()). `bench`, `verify --bench`, a playbook's bench task and a rollout's SLO gate
    all bench through here."""
    assert run.session is not None
    try:
        fits(spec, plan, inst)
    except DeployError as exc:
        return InstanceBench(inst.unit, inst.served_model_name, inst.port, "error",
                             f"{exc.message} (fix: {exc.hint})", spec)
    w = spec.workload
    result_dir = f"/tmp/ernie-deploy-bench-{secrets.token_hex(8)}"
    argv = instance_argv(spec, plan, inst, result_dir, RESULT_NAME)
    intent = Bench(f"{inst.unit}.service", local_url(inst.host, inst.port), inst.served_model_name, argv,
                   result_dir, plan.user, w.timeout)
    fleet.progress(plan.name, f"{inst.unit}: vllm bench serve, {w.num_prompts} requests "
                              f"(stopped after {w.timeout:g}s)")
    with fleet.step(run, f"bench {inst.unit}") as step:
        seen = parse(run.session.run(bench_command(intent, api_key(plan))).text)
        made = outcome(seen, spec, inst, plan.name)
        made.argv = argv
        step.evidence = [f"{inst.unit}: {made.status}: {made.message}"]
        if not made.ok:
            step.status = StepStatus.FAILED
    if made.raw is not None:
        made.saved = str(save_raw(save_dir or default_save_dir(), plan.name, inst.unit, made.raw))
    return made


def save_raw(save_dir: Path, host: str, unit: str, raw: Mapping[str, Any]) -> Path:
    """The raw result as DIR/HOST/UNIT-YYYYmmdd-HHMMSS.json, written whole (temporary file + rename)."""
    folder = save_dir / host
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{unit}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    temp = path.with_suffix(".json.part")
    temp.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    temp.replace(path)
    return path


def measured(made: InstanceBench) -> str:
    """What a bench measured, in one line (numbers even without SLOs)."""
    r = made.result
    if r is None:
        return made.message
    parts = [f"{r.completed if r.completed is not None else '?'} request(s) ok"
             + (f", {r.failed} failed" if r.failed else "")]
    for metric, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
        value = r.metric(metric, "p99")
        if value is not None:
            parts.append(f"{label} p99 {value:.1f} ms")
    if r.output_throughput is not None:
        parts.append(f"{r.output_throughput:.1f} tok/s" + (" (lower bound)" if r.partial else ""))
    return ", ".join(parts)


def bench_check(made: InstanceBench) -> CheckResult:
    """The bench itself as a check: it passes when vllm bench serve finished with a result (its SLO verdicts are
    checks of their own), and fails when nothing complete was measured (down, failed, timed out, bad workload)."""
    ran = made.status in (OK, "slo-failed")
    return CheckResult("bench", "pass" if ran else "fail",
                       f"vllm bench serve, {made.spec.workload.num_prompts} requests: "
                       + (measured(made) if ran else f"{made.status}: {made.message}"),
                       fix=None if ran else "ernie-deploy bench -i INV --limit HOST shows the whole run; fix what "
                                            "the message says (an instance down: ernie-deploy logs)",
                       instance=made.unit)


# The inventory variables that set an SLO (vllm_slo_*).
SLO_VARS = tuple(f"vllm_{name}" for name in BENCH_TYPES if name.startswith("slo_"))


def slo_vars(host_vars: Mapping[str, Any]) -> dict[str, Any]:
    """The SLO variables set on a host (its effective variables), by name."""
    return {name: host_vars[name] for name in SLO_VARS if host_vars.get(name) is not None}


@dataclass(eq=False)
class SloGate:
    """A rollout's SLO gate (docs/rolling.md, "SLO gate"): the instances of one batch, the canary, are benched
    after they passed the readiness gate and their checks, each against its host's SLOs; one that misses them
    fails like a failed start (rolled back, and the rollout stops). Shared by the rollout, which names the batch
    once its batches are formed, and each host's cycle, which benches when it works on that batch."""

    enabled: bool = True  # False: --no-slo-gate (the rollout says the gate was off)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # workload settings of this run (BENCH_TYPES)
    save_dir: Path | None = None  # where raw results go (default_save_dir())
    batch: int | None = None  # the gated batch, 1-based; None: none (no SLOs there, or the gate is off)
