"""`calibrate`: on one canary host per GPU class, deploy each candidate (TP × max_model_len × max_num_seqs,
planning/calibrate.py), bench it with the host's workload, judge it with its SLOs, keep the best that meets them;
then put back the release that ran before, whatever happened.

Per canary, one after another (a candidate takes the host's GPUs; canaries of different classes could run at
once, but one at a time keeps the controller's output and a Ctrl-C simple):
1. record: facts and the kept releases; the release whose files are installed is what comes back. A host with
   none (never deployed, or edited by hand) is refused: there would be nothing to restore.
2. each candidate, while the time bound lasts and no signal came: deploy it to the canary alone, the way
   `deploy` does (its values as the canary's inventory variables: render, stage, activate, readiness gate; a
   candidate that fails to start is put back by the deploy itself), then `vllm bench serve` per instance.
3. restore, in a `finally`: `rollback --to` the recorded release, then the facts read again must show that
   release installed and every instance serving. A signal (Ctrl-C, SIGTERM, SIGHUP) during 1-2 only stops the
   candidates: the restore runs on a fleet of its own, so it is not skipped by the abort the signal set.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.errors import DeployError, InventoryError
from ernie_deploy.orchestration.bench import BenchRunner, InstanceBench
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.restart import Restarter, RestartOptions
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import SnapshotOptions, down, take
from ernie_deploy.orchestration.transport import Connector, Progress, RemoteHost
from ernie_deploy.planning.bench import BenchSpec, spec_from_plan
from ernie_deploy.planning.calibrate import (
    Candidate,
    Grid,
    Measurement,
    best,
    canaries,
    choose,
    gpu_class,
    measure,
    measured_row,
    merge,
    overrides,
    with_vars,
)
from ernie_deploy.planning.datafiles import load_yaml, mapping
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.recommend import load_table
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.remote import releases

MET, SLO_FAILED, FAILED = "met", "slo-failed", "failed"
_DONE = (Status.OK, Status.CHANGED)


@dataclass(frozen=True)
class Canary:
    host: RemoteHost
    plan: HostPlan  # from the inventory
    spec: BenchSpec
    grid: Grid
    stands_for: tuple[str, ...] = ()  # the other selected hosts of its GPU class


@dataclass
class Trial:
    candidate: Candidate
    status: str  # met | slo-failed | failed
    message: str
    benches: list[InstanceBench] = field(default_factory=list)
    measurement: Measurement | None = None

    def to_json(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_json(), "status": self.status, "message": self.message,
                "measurement": self.measurement.to_json() if self.measurement else None,
                "instances": [b.to_json() for b in self.benches]}


@dataclass
class Calibration:
    """One canary's calibration: what was recorded, tried and restored, and the winner's row."""

    canary: Canary
    release: str | None = None  # the release that ran before, restored afterwards
    vllm_version: str | None = None  # the vLLM the host runs (the row records it)
    trials: list[Trial] = field(default_factory=list)
    stopped: str | None = None  # why candidates were left untried (time bound, signal)
    winner: tuple[Candidate, Measurement] | None = None
    row: dict[str, Any] | None = None
    restored: HostResult | None = None

    @property
    def host(self) -> str:
        return self.canary.host.name

    def to_json(self) -> dict[str, Any]:
        c = self.canary
        return {"host": self.host, "gpu_class": gpu_class(c.plan), "stands_for": list(c.stands_for),
                "release": self.release, "vllm_version": self.vllm_version,
                "workload": c.spec.workload.to_json(), "slo": c.spec.slo.to_json(),
                "skipped": [{"candidate": s.candidate.to_json(), "reason": s.reason} for s in c.grid.invalid],
                "not_tried": [x.to_json() for x in c.grid.over],
                "trials": [t.to_json() for t in self.trials], "stopped": self.stopped,
                "winner": {"candidate": self.winner[0].to_json(), "measurement": self.winner[1].to_json()}
                if self.winner else None,
                "row": self.row,
                "restored": None if self.restored is None else {
                    "ok": self.restored.status in _DONE, "status": self.restored.status.value,
                    "message": self.restored.message, "hint": self.restored.hint}}


def prepare(hosts: Sequence[RemoteHost], ctx: PlanContext, bound: int) -> list[Canary]:
    """The canaries with their workload, SLOs and candidates, all checked before anything connects: a host
    without an SLO (nothing to keep a candidate by) or without a valid candidate is bad input."""
    chosen, others = canaries(hosts, ctx)
    out = []
    for host, plan in chosen:
        spec = spec_from_plan(plan)
        if not spec.slo.any:
            raise InventoryError("no SLO is set: calibrate keeps only a candidate that meets them", where=host.name,
                                 hint="set at least one of vllm_slo_ttft_p99_ms, vllm_slo_tpot_p99_ms, "
                                      "vllm_slo_itl_p99_ms, vllm_slo_min_output_throughput, vllm_slo_min_goodput "
                                      "on the host or its group (docs/bench.md)")
        grid = choose(host, plan, spec, ctx, bound)
        if not grid.tried:
            why = "; ".join(f"{s.candidate.label()}: {s.reason}" for s in grid.invalid) or "the grid is empty"
            raise InventoryError(f"no candidate the planner accepts ({why})", where=host.name,
                                 hint="lower vllm_bench_input_len/vllm_bench_output_len, or check `ernie-deploy "
                                      f"plan --limit {host.name}`")
        out.append(Canary(host, plan, spec, grid, tuple(n for n, c in others if c == host.name)))
    return out


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")


class Calibrator:
    def __init__(self, ctx: PlanContext, connector: Connector, *, deploy: Options, restore: RestartOptions,
                 fleet_options: FleetOptions, time_bound: float, save_dir: Path, progress: Progress | None = None,
                 clock: Callable[[], float] = time.monotonic, now: Callable[[], str] = utc_now) -> None:
        """`deploy`: how each candidate is deployed; `restore`: how the recorded release is rolled back to (its
        mode and release are set here); `time_bound`: seconds after which no new candidate starts."""
        self.ctx, self.connector = ctx, connector
        self.deploy, self.restore = deploy, restore
        self.fleet_options, self.time_bound, self.save_dir = fleet_options, time_bound, save_dir
        self.progress: Progress = progress or (lambda host, what: None)
        self.clock, self.now = clock, now
        # The candidates' fleet: a signal sets its abort, which stops the candidates and nothing else.
        self.fleet = self._fleet()
        self.templates = unit_environment(deploy.templates)
        self.calibrations: list[Calibration] = []
        self.started = 0.0  # when run() began: the time bound covers every canary

    @property
    def stopped_by(self) -> int | None:
        return self.fleet.signal

    def _fleet(self) -> Fleet:
        fleet = Fleet(self.connector, self.fleet_options)
        fleet.progress = lambda host, what: self.progress(host, what)
        return fleet

    def run(self, canaries: Sequence[Canary]) -> list[HostResult]:
        results = []
        self.started = self.clock()
        with self.fleet.signals():  # also between the operations below, a signal only sets the abort
            for canary in canaries:
                cal = Calibration(canary)
                self.calibrations.append(cal)
                results.append(self._canary(cal))
        return results

    def _canary(self, cal: Calibration) -> HostResult:
        host, canary = cal.host, cal.canary
        if self.fleet.abort.is_set():
            return HostResult(host, Status.SKIPPED, "skipped before changing anything: interrupted")
        recorded = self._record(cal)
        if recorded.finished:
            return recorded
        try:
            self._candidates(cal)
        finally:
            cal.restored = self._restore(cal)
        restored, result = cal.restored, HostResult(host)
        cal.winner = best([(t.candidate, t.measurement) for t in cal.trials])
        if restored.status not in _DONE:
            result.fail(Status.UNREACHABLE if restored.status is Status.UNREACHABLE else Status.FAILED,
                        f"release {cal.release} NOT restored: {restored.message}",
                        restored.hint or f"ernie-deploy rollback -i INV --limit {host} --to {cal.release}")
        elif self.fleet.interrupted:
            result.fail(Status.FAILED, f"interrupted after {len(cal.trials)} candidate(s); release {cal.release} "
                        "restored; nothing written")
        elif cal.winner is None:
            result.fail(Status.FAILED, f"no candidate met every SLO ({len(cal.trials)} tried"
                        + (f"; {cal.stopped}" if cal.stopped else "") + f"); release {cal.release} restored; "
                        "nothing written", "see each candidate's verdicts: relax the vllm_slo_* limits, lower the "
                        "workload, or allow more candidates (--max-candidates, --time-bound)")
        else:
            candidate, m = cal.winner
            cal.row = measured_row(canary.plan, self._base_row(canary.plan), candidate, m, date=self.now(),
                                   spec=canary.spec, tried=len(cal.trials),
                                   vllm_version=cal.vllm_version or canary.plan.version)
            result.message = f"best: {candidate.label()}, {m.output_throughput:.1f} tok/s; release {cal.release} " \
                             "restored"
        return result

    def _base_row(self, plan: HostPlan) -> dict[str, Any]:
        """The settings of the table row the canary's plan used, for the measured row to keep."""
        row = next((r for r in self.ctx.table.rows if plan.gpu and r.gpu_count == plan.gpu_count
                    and any(g.name == plan.gpu.name for g in r.gpu_models)), None)
        return dict(row.settings) if row else {}

    def _record(self, cal: Calibration) -> HostResult:
        """The release installed now and the vLLM that runs, read from the host; the result fails when there is
        none to restore."""

        def look(run: HostRun[None]) -> None:
            snap = take(self.fleet, run, self.ctx, self.templates, SnapshotOptions(render=False))
            if snap is None or run.session is None:
                return
            kept = releases.parse_list(run.session.run(releases.list_command()).text)
            now = releases.current(kept, snap.facts.files)
            if now is None:
                run.result.fail(Status.FAILED, "no kept release matches the installed files (never deployed, or "
                                "changed by hand): there would be nothing to restore after calibrating",
                                f"deploy it first (ernie-deploy deploy -i INV --limit {run.host.name}), then "
                                "calibrate")
                return
            cal.release, cal.vllm_version = now.id, snap.plan.version

        self.progress(cal.host, "recording the release that runs")
        (run,) = self.fleet.run([cal.canary.host], [look])
        return run.result

    def _candidates(self, cal: Calibration) -> None:
        canary = cal.canary
        tried = canary.grid.tried
        for i, candidate in enumerate(tried):
            if self.fleet.abort.is_set():
                cal.stopped = f"interrupted: {len(tried) - i} candidate(s) not tried"
                return
            if self.clock() - self.started > self.time_bound:
                cal.stopped = f"time bound ({self.time_bound:g}s) reached: {len(tried) - i} candidate(s) not tried"
                return
            self.progress(cal.host, f"candidate {i + 1}/{len(tried)}: {candidate.label()}")
            cal.trials.append(self._trial(canary, candidate, len(tried)))

    def _trial(self, canary: Canary, candidate: Candidate, count: int) -> Trial:
        host = with_vars(canary.host, overrides(canary.plan, candidate, count + 2))
        (deployed,) = Runner(self.ctx, self.connector, self.deploy, fleet=self.fleet).run([host])
        if deployed.status not in _DONE:
            return Trial(candidate, FAILED, f"deploy: {deployed.message}")
        bench = BenchRunner(self.ctx, self.fleet, save_dir=self.save_dir)
        (benched,) = bench.run([host])
        benches = bench.reports.get(host.name, [])
        met = benched.status in _DONE and bool(benches) and all(b.ok for b in benches)
        m = measure([b.result for b in benches], met)
        if met:
            return Trial(candidate, MET, benched.message, benches, m)
        judged = bool(benches) and all(b.status in ("ok", "slo-failed") for b in benches)
        why = "; ".join(f"{b.unit}: " + (", ".join(v.summary for v in b.verdicts if not v.ok) or b.message)
                        for b in benches if not b.ok) or benched.message
        return Trial(candidate, SLO_FAILED if judged else FAILED, why, benches, m)

    def _restore(self, cal: Calibration) -> HostResult:
        """Roll back to the recorded release, on a fleet of its own, then read the facts again: that release
        installed and every instance of the plan serving, or the result fails saying what is wrong."""
        assert cal.release is not None
        host = cal.canary.host
        self.progress(host.name, f"restoring release {cal.release}")
        fleet = self._fleet()
        options = dataclasses.replace(self.restore, mode="rollback", to=cal.release, instance=None, check=False)
        (rolled,) = Restarter(self.ctx, self.connector, options, fleet=fleet).run([host])
        if rolled.status not in _DONE:
            return rolled

        def verify(run: HostRun[None]) -> None:
            snap = take(fleet, run, self.ctx, self.templates, SnapshotOptions(render=False))
            if snap is None or run.session is None:
                return
            kept = releases.parse_list(run.session.run(releases.list_command()).text)
            now = releases.current(kept, snap.facts.files)
            problems = down(run.host.name, snap, [f"{i.unit}.service" for i in snap.plan.instances],
                            installed_only=False)
            if now is None or now.id != cal.release or problems:
                installed = f"release {now.id}" if now else "files of no kept release"
                run.result.fail(Status.FAILED, f"after the rollback the host has {installed}"
                                + (f"; not serving: {'; '.join(problems)}" if problems else ""),
                                f"ernie-deploy rollback -i INV --limit {run.host.name} --to {cal.release}")

        (checked,) = [run.result for run in fleet.run([host], [verify])]
        if checked.status in _DONE:
            checked.message = f"{rolled.message}; release {cal.release} installed, every instance serving"
        return checked


HEADER = ("# Written by `ernie-deploy calibrate` (docs/calibrate.md): a recommended-config table with measured\n"
          "# rows. Use it with `ernie-deploy plan|deploy --table FILE`; a later calibrate replaces the row of the\n"
          "# same GPU class. Comments of the file it started from are not kept.\n")


def write_table(path: Path, base: Path, rows: Sequence[dict[str, Any]], ctx: PlanContext) -> None:
    """Merge `rows` into the table at `path` (started from the table at `base`, the one the run planned with,
    when `path` does not exist yet), check that it loads as a table, and replace the file whole."""
    source = path if path.exists() else base
    table: dict[str, Any] = dict(mapping(load_yaml(source), str(source), "(top level)"))
    for row in rows:
        table = merge(table, row, ctx.catalog)
    temp = path.with_name(f".{path.name}.part")
    temp.write_text(HEADER + yaml.safe_dump(table, sort_keys=False, allow_unicode=True), encoding="utf-8")
    try:
        load_table(ctx.catalog, temp)
    except DeployError:
        temp.unlink()
        raise
    temp.replace(path)
