"""One host's instances through a restart cycle, one at a time, and the automatic rollback of a failed one.

Per instance: pre-drain hook (out of the load balancer) → wait until vLLM's running + waiting requests reach 0
→ stop (SIGTERM; vLLM drains within --shutdown-timeout) → wait until its GPUs are free (no process, used
memory back to the baseline taken at its start) → start → readiness gate → post-ready hook. A host whose
change moves GPUs between its instances goes as a whole: drain all, stop all, start all.

A failed start restores what ran before (the host's release from before the change), restarts and
re-verifies it; units staged but not reached yet get their files back, so nothing stays half-applied.

With the fleet's balancers (`CycleOptions.balancers`, docs/balancer.md), an instance one of them fronts is set
to drain there before anything else happens to it, and the cycle waits until each reports no session on it
(phase "balancer"); hooks run in addition. After the readiness gate it is set ready again, and the next instance
goes only once every fronting balancer sees it UP: capacity is back before more is taken.

Every instance taken out of the load balancer (drained on a balancer, or whose pre-drain hook ran with a
post-ready hook to undo it) is recorded out of rotation (`hooks.Rotation`) before it is taken out, and put back
(set ready, post-ready) wherever it ends serving: passed, kept serving because the rollout stopped before its
stop, or rolled back and verified. One that does not serve stays recorded; the rollout names it and `--resume`
puts it back once it serves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ernie_deploy.checks import gpurelease
from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.checks.metrics import in_flight
from ernie_deploy.checks.result import CheckInputError, CheckResult
from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import hooks, readiness
from ernie_deploy.orchestration.balancers import BalancerControl, ServerStat
from ernie_deploy.orchestration.bench import SloGate, bench_check, bench_instance
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.instancecheck import api_key, instance_checks, requests_for
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.steps import Step, StepStatus
from ernie_deploy.orchestration.timeline import Timeline
from ernie_deploy.orchestration.transport import Transport
from ernie_deploy.planning.balancer import DEFAULTS as BALANCER_DEFAULTS
from ernie_deploy.planning.balancer import BalancerBackend, BalancerPlan, BalancerServer
from ernie_deploy.planning.bench import BenchSpec, fits, spec_from_plan
from ernie_deploy.planning.hostpaths import RELEASES_DIR, local_url
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.playbook.actions import ACTIONS
from ernie_deploy.remote import converge, http, probe, releases, rolling
from ernie_deploy.remote.protocol import MARK
from ernie_deploy.remote.ssh import Failure, RemoteError
from ernie_deploy.remote.systemd import UnitState

_ROLLING = ACTIONS["rolling"].args
# templates/haproxy.cfg.j2's `default-server ... rise 2`: passing checks in a row before HAProxy calls a server UP.
RISE = 2
BALANCER_POLL = 0.25  # seconds between reads of a balancer's `show stat` while waiting on it


def up_timeout(check_interval: float) -> float:
    """How long a balancer may take to see an instance UP once it is set ready: `rise` passing checks
    `check_interval` apart, twice over (a check that began before vLLM answered fails first), and 5 s for the
    runtime API's round trips over SSH."""
    return 2 * RISE * check_interval + 5.0


@dataclass(frozen=True)
class CycleOptions:
    command: str = "deploy"  # deploy | restart | rollback: hooks and the audit log see it
    pre_drain: str | None = None
    post_ready: str | None = None
    # The defaults are the playbook's rolling task's (one table for the task, the command line and this).
    hook_timeout: float = _ROLLING["hook_timeout"].default
    idle_timeout: float = _ROLLING["idle_timeout"].default  # for in-flight requests to reach 0 after pre-drain
    gpu_timeout: float = _ROLLING["gpu_release_timeout"].default  # for an instance's GPUs to be free after stop
    parallel_instances: bool = _ROLLING["parallel_instances"].default
    rollback: bool = _ROLLING["rollback"].default  # restore the previous release of a failed instance
    health_timeout: float = 0.0  # 0: the host's vllm_startup_budget
    stable: float | None = None  # None: the host's vllm_stable_seconds
    poll: float = 0.5
    # The fleet's balancers, driven around every instance one of them fronts; None: none in the inventory, or
    # --no-balancer. Their plans name each instance's server (backend, address) and set how long one may take
    # to come UP (its check interval).
    balancers: BalancerControl | None = None
    balancer_plans: tuple[BalancerPlan, ...] = ()
    balancer_poll: float = BALANCER_POLL
    balancer_up_timeout: float | None = None  # None: up_timeout() of the fronting balancers' check interval
    # The rollout's SLO gate (shared with RolloutOptions, which names its batch); None: no gate.
    slo_gate: SloGate | None = None


@dataclass
class Work:
    """What to cycle on one host, decided before anything is touched."""

    plan: HostPlan
    instances: list[InstancePlan]  # in order; their values are what the readiness gate expects
    running: set[str]  # units running now: stopped before they start again
    serving: set[str]  # units serving now: drained first
    whole: list[str] = field(default_factory=list)  # why the host must go as a whole (GPUs move)
    activation: converge.Changes = field(default_factory=converge.Changes)  # host-wide part of the first start
    undo_to: dict[str, releases.Release] = field(default_factory=dict)  # unit → the release it ran before
    revertible: bool = True  # False for a restart: the files did not change, there is nothing to go back to
    batch: int = 1
    stop_first: tuple[str, ...] = ()  # units outside the plan that hold GPUs the plan needs (pruned)
    # The output of a GPU reading taken right before the cycle (by deploy's stage), for the first group when
    # nothing stops before it starts: the gate's first reading.
    reading: str | None = None


def groups_of(work: Work, opts: CycleOptions) -> list[list[InstancePlan]]:
    """The instances in the groups the cycle takes one after another: all at once when the host goes as a whole
    or its instances restart in parallel, else one by one."""
    insts = work.instances
    return [insts] if work.whole or opts.parallel_instances else [[i] for i in insts]


def first_start(work: Work, opts: CycleOptions) -> list[str]:
    """The units of the first group when it starts with nothing to stop first (a host's first start, or new
    instances), whose GPU reading can come with the stage; else none."""
    groups = groups_of(work, opts)
    if not groups or work.stop_first or any(unit_of(i) in work.running for i in groups[0]):
        return []
    return [unit_of(i) for i in groups[0]]


def unit_of(inst: InstancePlan) -> str:
    return f"{inst.unit}.service"


def as_released(inst: InstancePlan, values: dict[str, str]) -> InstancePlan:
    """The instance as a kept release's unit file runs it: a rollback is verified against what it restores."""
    def num(key: str, default: int | None) -> int | None:
        return int(values[key]) if values.get(key, "").isdigit() else default

    gpus = values.get("gpus", "")
    return dataclasses.replace(
        inst, port=num("port", inst.port) or inst.port, host=values.get("host", inst.host),
        served_model_name=values.get("served-model-name", inst.served_model_name),
        tensor_parallel_size=num("tensor-parallel-size", 1) or 1,
        pipeline_parallel_size=num("pipeline-parallel-size", 1) or 1,
        max_model_len=num("max-model-len", None),
        gpus=tuple(int(g) for g in gpus.split(",") if g.strip().isdigit()) or inst.gpus, memory=None)


def released_instances(session: Transport, release: releases.Release, plan: HostPlan,
                       insts: Sequence[InstancePlan]) -> list[InstancePlan]:
    """Read the release's unit files of these instances (one command) and describe them as it runs them."""
    wanted = [i for i in insts if releases.has_unit(release, unit_of(i))]
    if not wanted:
        return []
    paths = [f"{RELEASES_DIR}/{release.id}{releases.unit_path(unit_of(i))}" for i in wanted]
    texts = converge.parse_read(session.run(converge.read_command(paths)).text)
    return [as_released(i, releases.unit_values(texts.get(p, ""))) for i, p in zip(wanted, paths, strict=True)]


class HostCycle:
    def __init__(self, fleet: Fleet, run: HostRun[Any], work: Work, opts: CycleOptions, exp: Expectations,
                 timeline: Timeline, audit: Callable[[str], dict[str, Any]], rotation: hooks.Rotation) -> None:
        assert run.session is not None
        self.fleet, self.run, self.work, self.opts, self.exp = fleet, run, work, opts, exp
        self.session = run.session
        self.timeline = timeline
        self.audit = audit
        self.rotation = rotation
        self.pulled: set[str] = set()  # units this cycle recorded out of rotation and has not put back
        self.hooked: set[str] = set()  # units whose pre-drain hook ran (or started) and whose post-ready is owed
        self.drained: set[str] = set()  # units set to drain (or asked to) on their balancers, not ready again
        self.result = run.result
        self.change = run.result.changing()
        self.plan = work.plan
        self.started_at = 0.0  # timeline time of the last start, where the load span begins
        self.gate: BenchSpec | None = None  # the SLO gate's spec when this host's batch is gated and has SLOs

    # -- the flow ------------------------------------------------------------------------------------
    def go(self) -> bool:
        """Every instance of the work, group by group; False when one failed (the result says what was undone)."""
        if not self._gate_ready():
            return False
        groups = groups_of(self.work, self.opts)
        for k, group in enumerate(groups):
            later = [i for g in groups[k + 1:] for i in g]
            if self.fleet.abort.is_set():
                self._stopped("before " + ", ".join(i.unit for i in group), group + later)
                return False
            if not self._group(group, first=k == 0, later=later):
                return False
        return True

    def _group(self, group: list[InstancePlan], first: bool, later: list[InstancePlan]) -> bool:
        serving = [i for i in group if unit_of(i) in self.work.serving]
        running = [i for i in group if unit_of(i) in self.work.running]
        if not self._out_of_rotation(serving, group + later):
            return False
        drained = {unit_of(i): self._wait_idle(i) for i in serving}
        if self.fleet.abort.is_set():  # drained but not stopped yet: it keeps serving; put it back
            self._back_in_rotation(serving)
            self._stopped("before stopping " + ", ".join(i.unit for i in group), group + later)
            return False
        stop_first = self.work.stop_first if first else ()
        stops = [(unit, None) for unit in stop_first] + [(unit_of(i), i) for i in running]
        # The last stop reads the group's GPUs too: the gate's first reading, no round trip of its own; with
        # nothing to stop, the stage's reading is (first group only: later ones start after GPUs changed).
        reading = self.work.reading if first and not stops else None
        for k, (unit, inst) in enumerate(stops):
            reading = self._stop_unit(unit, inst, drained.get(unit, 0.0),
                                      [unit_of(i) for i in group] if k == len(stops) - 1 else [])
        release = self._gpus_free(group, reading, stopped=bool(stops))
        if not release.free:
            self._undo(group, later, None, restart=False)
            return False
        launched = self._start(group, first)
        failed = self._ready(group, launched)
        if self.fleet.abort.is_set():  # the watch was cut short: nothing failed, nothing was verified
            self._stopped("while " + ", ".join(i.unit for i in group) + " started (not verified: rerun to check "
                          "it)", later)
            return False
        if failed:
            self._undo(group if self.work.whole else failed, later, None)
            return False
        for inst in group:
            if unit_of(inst) in self.drained and not self._balancer_ready(inst):
                self._back_in_rotation([inst])  # it serves: post-ready still runs for it
                self._undo([], later, None)
                return False
            if self.opts.post_ready and not self._hook("post-ready", self.opts.post_ready, inst):
                self._undo([], later, None)
                return False
            self.hooked.discard(unit_of(inst))
            self.rotation.back(self.plan.name, unit_of(inst))
            self.pulled.discard(unit_of(inst))
        return True

    def _out_of_rotation(self, serving: list[InstancePlan], rest: list[InstancePlan]) -> bool:
        """Take the serving instances out of the load balancer before anything stops: drained on every balancer
        that fronts them (waiting until it holds no session on them), then the pre-drain hook. False when that
        failed: whatever was taken out is put back, the instances not reached get their files back, and nothing
        was stopped."""
        lb = self.opts.balancers
        fronted = [i for i in serving if lb is not None and lb.fronting(self.plan.name, i.index)]
        for inst in serving:
            if any(i.unit == inst.unit for i in fronted) or (self.opts.pre_drain and self.opts.post_ready):
                # Recorded before anything takes it out: a controller killed half-way leaves the record behind.
                self.rotation.pulled(self.plan.name, unit_of(inst))
                self.pulled.add(unit_of(inst))
        if fronted and not self._balancer_drain(fronted):
            self._back_in_rotation(serving)  # ready again where it did drain
            self._undo([], rest, "a balancer could not drain it; nothing was stopped")
            return False
        for inst in fronted:
            self._balancer_idle(inst)
        for inst in serving:
            if not self.opts.pre_drain:
                break
            if self.opts.post_ready:
                self.hooked.add(unit_of(inst))  # a failed hook may have taken it out half-way
            if not self._hook("pre-drain", self.opts.pre_drain, inst):
                self._back_in_rotation(serving)
                self._undo([], rest, "the pre-drain hook failed; nothing was stopped")
                return False
        return True

    def _stopped(self, where: str, unreached: list[InstancePlan]) -> None:
        """The run was stopped (Ctrl-C, or another host failed with --any-errors-fatal): instances not reached
        get their files back, so the host runs and holds one release per instance again."""
        why = "interrupted" if self.fleet.interrupted else "another host failed (--any-errors-fatal)"
        self.result.fail(Status.FAILED, f"stopped {where}: {why}", self.result.hint)
        self._undo([], unreached, None)

    def _back_in_rotation(self, insts: list[InstancePlan]) -> bool:
        """Instances taken out of the balancer that serve (the rollout stopped before their stop, or they were
        rolled back and verified): set ready again on their balancers, and post-ready. False when either failed
        (they stay recorded; the result says so)."""
        ok = True
        for inst in insts:
            unit = unit_of(inst)
            if unit not in self.pulled:
                continue
            problems = self._set_ready(inst) if unit in self.drained else []
            if problems:
                self.result.evidence.append(f"{inst.unit}: still drained on its balancer: " + "; ".join(problems)
                                            + " (--resume sets it ready once it serves)")
            if unit in self.hooked and self.opts.post_ready \
                    and self._hook("post-ready", self.opts.post_ready, inst, fail=False):
                self.hooked.discard(unit)
            if unit in self.drained or unit in self.hooked:
                ok = False
                continue
            self.rotation.back(self.plan.name, unit)
            self.pulled.discard(unit)
        return ok

    # -- the balancers -------------------------------------------------------------------------------
    def _server(self, inst: InstancePlan) -> list[tuple[str, BalancerBackend, BalancerServer, float]]:
        """(balancer host, backend, server, check interval) of each balancer plan that fronts the instance."""
        out = []
        for plan in self.opts.balancer_plans:
            found = plan.server_for(self.plan.name, inst.index)
            if found is not None:
                out.append((plan.host, found[0], found[1], plan.check_interval))
        return out

    def _name(self, inst: InstancePlan) -> str:
        """The instance's server as HAProxy knows it, for messages."""
        found = self._server(inst)
        return f"{found[0][1].name}/{found[0][2].name}" if found else f"{self.plan.name}-{inst.index}"

    def _balancer_drain(self, insts: list[InstancePlan]) -> bool:
        """Set the instances to drain on every balancer fronting them, all before waiting on any. A problem fails
        the host (naming the balancer): the rollout stops before anything is stopped."""
        lb = self.opts.balancers
        assert lb is not None
        names = ", ".join(i.unit for i in insts)
        self.fleet.progress(self.plan.name, f"balancer: draining {names}")
        problems: list[str] = []
        with self.fleet.step(self.run, f"balancer set drain {names}") as step:
            for inst in insts:
                self.drained.add(unit_of(inst))  # before the call: it may drain on some balancers and not others
                problems = lb.set_state(self.plan.name, inst.index, "drain")
                step.changed = True
                if problems:
                    step.status, step.evidence = StepStatus.FAILED, [*step.evidence, *problems]
                    break
                where = ", ".join(lb.fronting(self.plan.name, inst.index))
                step.evidence.append(f"{inst.unit}: server {self._name(inst)} set to drain on {where}")
        if problems:
            self.result.fail(Status.FAILED, "the balancer could not drain " + names + ": " + "; ".join(problems),
                             "fix the balancer as the message says, then rerun (a rollout of several batches "
                             "continues with --resume); --no-balancer restarts without it, losing the requests "
                             "sent to each instance while it restarts")
            return False
        return True

    def _balancer_idle(self, inst: InstancePlan) -> None:
        """Wait until every balancer fronting the instance holds no session on it (bounded by --idle-timeout).
        What it still holds then, or a balancer that cannot be read, is a warning: the drain is set, and vLLM's
        own idle wait and --shutdown-timeout still let those requests finish."""
        lb = self.opts.balancers
        assert lb is not None
        start = time.monotonic()
        with self._phase(f"balancer drain {inst.unit}", "balancer", [unit_of(inst)]) as step:
            while True:
                stats, problems = lb.stats(self.plan.name, inst.index)
                busy = {host: s.scur for host, s in stats.items() if s.scur}
                if problems or not busy or self.fleet.abort.is_set() \
                        or time.monotonic() - start >= self.opts.idle_timeout:
                    break
                time.sleep(self.opts.balancer_poll)
            waited = time.monotonic() - start
            if not busy and not problems:
                step.evidence = [f"{inst.unit}: no session on {', '.join(sorted(stats))} after {waited:.1f}s"]
                return
            step.status = StepStatus.WARN
            held = [f"{n} session(s) on {host}" for host, n in sorted(busy.items())]
            step.evidence = [f"{inst.unit}: " + "; ".join(held + problems) + f" after {waited:.1f}s; going on (the "
                             "drain is set; vLLM's idle wait and --shutdown-timeout let them finish)"]
            self.result.checks.append(CheckResult(
                "balancer drain", "warn", step.evidence[0], instance=inst.unit,
                fix="raise --idle-timeout for long generations" if busy else
                    "check the balancer as the message says (its drain was set)"))

    def _set_ready(self, inst: InstancePlan) -> list[str]:
        """Set the instance ready again on every balancer fronting it; the problems (it stays drained on those)."""
        lb = self.opts.balancers
        assert lb is not None
        with self.fleet.step(self.run, f"balancer set ready {inst.unit}") as step:
            problems = lb.set_state(self.plan.name, inst.index, "ready")
            step.changed = True
            if problems:
                step.status, step.evidence = StepStatus.FAILED, list(problems)
            else:
                self.drained.discard(unit_of(inst))
                step.evidence = [f"{inst.unit}: server {self._name(inst)} set ready"]
        return problems

    def _balancer_ready(self, inst: InstancePlan) -> bool:
        """After the readiness gate: set ready again on every balancer fronting it, and wait until each sees it UP
        (its health check passed), so capacity is back before the next instance goes. False (the host failed,
        the instance kept: it serves) when a balancer could not be set or does not see it UP in time."""
        lb = self.opts.balancers
        assert lb is not None
        unit = unit_of(inst)
        self.fleet.progress(self.plan.name, f"balancer: {inst.unit} ready, waiting until it is UP")
        problems = self._set_ready(inst)
        if problems:
            self.result.fail(Status.FAILED, f"{inst.unit} serves again, but its balancer could not set it ready: "
                             + "; ".join(problems), "fix the balancer as the message says, then rerun with "
                             "--resume: it sets the instance ready once it serves")
            return False
        servers = self._server(inst)
        limit = self.opts.balancer_up_timeout
        if limit is None:  # the default check interval when no plan names the server
            limit = max((up_timeout(interval) for *_, interval in servers),
                        default=up_timeout(float(BALANCER_DEFAULTS["balancer_check_interval"])))
        start = time.monotonic()
        with self._phase(f"balancer ready {inst.unit}", "balancer", [unit]) as step:
            while True:
                stats, problems = lb.stats(self.plan.name, inst.index)
                down = {host: s for host, s in stats.items() if not s.up}
                if not down and not problems:
                    step.evidence = [f"{inst.unit}: UP on {', '.join(sorted(stats))} after "
                                     f"{time.monotonic() - start:.1f}s"]
                    break
                if self.fleet.abort.is_set() or time.monotonic() - start >= limit:
                    step.status = StepStatus.FAILED
                    step.evidence = [self._not_up(inst, down, problems, time.monotonic() - start)]
                    break
                time.sleep(self.opts.balancer_poll)
        if step.status is not StepStatus.FAILED:
            return True
        if self.fleet.abort.is_set():
            self.result.fail(Status.FAILED, f"stopped while waiting for the balancer to see {inst.unit} UP: "
                             + ("interrupted" if self.fleet.interrupted else "another host failed "
                                "(--any-errors-fatal)"), self.result.hint)
            return False
        address = next((f"{s.address}:{s.port}" for _, _, s, _ in servers), f"{self.plan.address}:{inst.port}")
        self.result.fail(Status.FAILED, step.evidence[0],
                         f"the balancer cannot reach {address}, or its health check (a 1-token completion of "
                         f"{inst.served_model_name}) fails there: check the network and vllm_host from the balancer "
                         "host; the instance passed the readiness gate and was kept; once the balancer sees it UP "
                         "(ernie-deploy status), rerun (--resume continues with the next batch)")
        return False

    def _not_up(self, inst: InstancePlan, down: dict[str, ServerStat], problems: list[str], waited: float) -> str:
        names = {host: f"{backend.name}/{server.name}" for host, backend, server, _ in self._server(inst)}
        said = [f"{host}: server {names.get(host, self._name(inst))} is {s.status} {waited:.0f}s after it was set "
                "ready" for host, s in sorted(down.items())]
        return f"{inst.unit}: " + "; ".join(said + problems)

    # -- steps ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _phase(self, name: str, phase: str, units: Sequence[str], since: float | None = None) -> Iterator[Step]:
        """The one record of a phase: a step of the host (its JSON and timings) that the timeline draws too.
        `since`: where the phase began on the rollout's clock, when before the step (a load starts with the
        start command)."""
        began = self.timeline.now()
        with self.fleet.step(self.run, name) as step:
            yield step
        # Only a phase that ran to its end is drawn and timed; an error leaves a failed step, as any step.
        step.phase, step.units = phase, tuple(units)
        step.started, step.ended = began if since is None else since, self.timeline.now()
        self.timeline.record(self.plan.name, step)

    def _hook(self, name: str, shell: str, inst: InstancePlan, fail: bool = True) -> bool:
        self.fleet.progress(self.plan.name, f"{name} hook for {inst.unit}")
        with self._phase(f"{name} hook {inst.unit}", "hook", [unit_of(inst)]) as step:
            env = hooks.environment(name, self.opts.command, self.plan, inst, self.work.batch)
            done = hooks.run(name, shell, env, self.opts.hook_timeout)
            step.evidence = [done.summary, *done.output]
            if not done.ok:
                step.status = StepStatus.FAILED
        if not done.ok and fail:
            self.result.fail(Status.FAILED, f"{inst.unit}: {done.summary}",
                             f"fix the {name} hook (its output is in the evidence), then rerun (a rollout of "
                             "several batches continues with --resume)")
            self.result.evidence = done.output
        elif not done.ok:
            self.result.evidence.append(f"{inst.unit}: {done.summary}: put it back into the balancer by hand")
        return done.ok

    def _wait_idle(self, inst: InstancePlan) -> float:
        """Poll /metrics until running + waiting reach 0, or the idle timeout passes (a warning, not a failure:
        vLLM's --shutdown-timeout still lets the last requests finish on stop)."""
        start = time.monotonic()
        unit = unit_of(inst)
        self.fleet.progress(self.plan.name, f"draining {inst.unit}")
        request = http.Request(f"{inst.unit} metrics", f"{local_url(inst.host, inst.port)}/metrics", timeout=5)
        command = rolling.metrics_command(unit, request)
        with self._phase(f"drain {inst.unit}", "drain", [unit]) as step:
            left: int | None = None
            while True:
                asked = time.monotonic()
                answer = http.missing(http.parse(self.session.run(command).text), request.id)
                left = in_flight(answer.body.decode(errors="replace")) if answer.status == 200 else None
                if left == 0 or self.fleet.abort.is_set() or time.monotonic() - start >= self.opts.idle_timeout:
                    break
                time.sleep(readiness.pause(self.opts.poll, time.monotonic() - asked))
            waited = time.monotonic() - start
            if left == 0:
                step.evidence = [f"{inst.unit}: 0 requests running or waiting after {waited:.1f}s"]
            else:
                step.status = StepStatus.WARN
                shown = "unknown (no vLLM metrics)" if left is None else str(left)
                step.evidence = [f"{inst.unit}: {shown} request(s) still in flight after the idle timeout of "
                                 f"{self.opts.idle_timeout:.0f}s; stopping anyway (vLLM's --shutdown-timeout "
                                 "lets them finish)"]
                self.result.checks.append(CheckResult("drain", "warn", step.evidence[0], instance=inst.unit,
                                                      fix="check that the pre-drain hook takes the instance out "
                                                          "of the load balancer, or raise --idle-timeout"))
        return waited

    def _stop_unit(self, unit: str, inst: InstancePlan | None, drained: float,
                   gpu_units: list[str]) -> str | None:
        """Stop the unit; with `gpu_units`, the output of the GPU reading taken right after (else None)."""
        self.fleet.progress(self.plan.name, f"stopping {unit}")
        with self._phase(f"stop {unit}", "stop", [unit]) as step:
            audit = {**self.audit("stop"), "unit": unit, "drained_seconds": round(drained, 1)}
            out = self.session.run(rolling.stop_command(unit, audit, gpu_units)).text
            stopped = rolling.parse_stop(out)
            step.changed = True
            step.evidence = [f"{unit}: {stopped.state or 'stopped'}"]
            if stopped.killed:
                step.status = StepStatus.WARN
                self.result.checks.append(CheckResult(
                    "stop", "warn", f"{unit}: the process did not stop within TimeoutStopSec and was killed "
                    "(SIGKILL): requests still in flight were cut", instance=unit.removesuffix(".service"),
                    fix="raise vllm_drain_timeout if requests need longer to finish"))
        # A host whose output lacks the reading (a wrapper that cut it short) is asked again on its own.
        return out if gpu_units and f"{MARK}gpus" in out else None

    def _gpus_free(self, group: list[InstancePlan], first: str | None = None,
                   stopped: bool = True) -> gpurelease.Release:
        """Wait until every GPU of the group is free; a holder still there at the timeout fails, named by PID.
        `first`: the output of a reading taken already (the stop's or the stage's), judged before any new one is
        asked. `stopped`: whether something was stopped for the group (else it is a first start)."""
        start = time.monotonic()
        gpus = sorted({g for i in group for g in i.gpus})
        self.fleet.progress(self.plan.name, f"waiting for GPU(s) {','.join(map(str, gpus))} to be released")
        name = " ".join(i.unit for i in group)
        with self._phase(f"gpu release {name}", "gpu-release", [unit_of(i) for i in group]) as step:
            while True:
                asked = time.monotonic()
                # One reading that is free is enough: it is taken after the stop returned, when systemd saw every
                # process of the unit exit, and the driver frees an exited process's memory asynchronously
                # (unsloth PR #5693) but within 0.05 s (measured on an H200); memory not back yet reads as held,
                # and the next reading follows as soon as the host answers.
                verdict = self._gpu_reading(group, gpus, first)
                first = None
                now = time.monotonic()
                # Not cut short by Ctrl-C: the instance is stopped, and starting it again needs free GPUs.
                if verdict.free or now - start >= self.opts.gpu_timeout:
                    break
                time.sleep(readiness.pause(self.opts.poll, now - asked))
            step.evidence = [f"GPU(s) {','.join(map(str, gpus))}: {verdict.describe()} after {now - start:.1f}s"]
            if not verdict.free:
                step.status = StepStatus.FAILED
                pids = " ".join(str(h.pid) for h in verdict.holders)
                when = f"not released {now - start:.0f}s after the stop" if stopped else \
                    f"not free for the first start ({now - start:.0f}s waited)"
                self.result.fail(
                    Status.FAILED, f"GPU(s) of {name} {when}: {verdict.describe()}; nothing was started on them",
                    (f"an orphan keeps the GPU memory: stop it (kill {pids}), then rerun" if pids else
                     "find what holds the memory (nvidia-smi), free it, then rerun")
                    + (" (the instance stays stopped" if stopped else " (it was not started")
                    + ": a start now would fail vLLM's free-memory check)")
        return verdict

    def _gpu_reading(self, group: list[InstancePlan], gpus: list[int], text: str | None = None) -> gpurelease.Release:
        units = [unit_of(i) for i in group]
        try:
            reading = rolling.parse_gpus(self.session.run(rolling.gpu_command(units)).text if text is None else text)
        except CheckInputError as exc:
            raise RemoteError(Failure.COMMAND, f"nvidia-smi output unusable: {exc.message}",
                              where=self.plan.name) from None
        if any(reading.states.get(u, UnitState()).active_state not in ("inactive", "failed", "") for u in units):
            return gpurelease.Release(False)  # still stopping: its processes may hold the GPUs
        baseline = {g: mib for u in units for g, mib in reading.baselines.get(u, {}).items()}
        # Instances the plan puts on the same GPUs (vllm_share_gpus) keep theirs; any other process holds them.
        siblings = {unit_of(i) for i in self.plan.instances if unit_of(i) not in units and set(i.gpus) & set(gpus)}
        sharing = {pid for pid, unit in reading.units.items() if unit in siblings}
        return gpurelease.judge(gpus, reading.rows, reading.apps, reading.names, baseline, sharing)

    def _start(self, group: list[InstancePlan], first: bool) -> dict[str, converge.Started]:
        units = tuple(unit_of(i) for i in group)
        changes = dataclasses.replace(self.work.activation, restart=(), start=units) if first \
            else converge.Changes(start=units)
        self.fleet.progress(self.plan.name, "starting " + " ".join(units))
        self.started_at = self.timeline.now()
        with self.fleet.step(self.run, "start " + " ".join(i.unit for i in group)) as step:
            out = self.session.run(converge.activate_command(
                changes, self.audit("start"), {unit_of(i): i.gpus for i in group})).text
            step.changed = True
            launched = converge.started_units(out)
            missing = [u for u in units if u not in launched]
            if missing:
                # Nothing can be verified without knowing which run to watch: never call it ok.
                raise RemoteError(Failure.COMMAND, "activate printed no start marker for "
                                  f"{', '.join(missing)}, so the started units could not be verified",
                                  where=self.plan.name,
                                  hint="check that the host's shell runs the activate script unchanged "
                                       "(sudo wrappers that swallow output?), then deploy again")
        return launched

    def _ready(self, group: list[InstancePlan], launched: dict[str, converge.Started],
               rolled_back: bool = False) -> list[InstancePlan]:
        """Readiness watch of each instance, its checks run once it serves (inside the stability window, which
        goes on meanwhile), then the SLO gate; the instances that failed (the result says why)."""
        plan, result = self.plan, self.result
        budget = self.opts.health_timeout or plan.tuning.startup_budget
        stable = self.opts.stable if self.opts.stable is not None else plan.tuning.stable_seconds
        failed: list[InstancePlan] = []
        for inst in group:
            self.fleet.progress(plan.name, f"waiting for {inst.unit} to become ready")
            checked: list[bool] = []  # whether its checks passed, once they ran

            def check(inst: InstancePlan = inst, checked: list[bool] = checked) -> bool:
                # Once the run is stopped nothing is verified: the rollout says so (go's caller).
                checked.append(self.fleet.abort.is_set() or not self._checks([inst], rolled_back))
                return checked[-1]

            # Loading began with the start; it ends where the instance first served, the stability window and
            # the checks are "ready".
            with self._phase(f"ready {inst.unit}", "ready", [unit_of(inst)], since=self.started_at) as step:
                watched = self.timeline.now()
                ready = readiness.watch(self.session, plan, inst, started=launched[unit_of(inst)], budget=budget,
                                        exp=self.exp, abort=self.fleet.abort, stable=stable, poll=self.opts.poll,
                                        on_serving=check)
                step.evidence, step.restored = [ready.summary], rolled_back
                if ready.healthy_after is not None:
                    step.healthy = watched + ready.healthy_after
                if ready.status != "ready":
                    step.status = StepStatus.FAILED
            if ready.status != "ready":
                failed.append(inst)
                if not rolled_back and checked != [False]:  # failed checks failed the result themselves
                    result.fail(Status.FAILED, ready.summary,
                                " · ".join(x for x in (ready.cause, ready.fix) if x) or None)
                    result.evidence = ready.evidence
        passed = [i for i in group if i not in failed]
        if self.gate is not None and not rolled_back and passed and not self.fleet.abort.is_set():
            failed += self._slo_gate(passed, self.gate)
        return failed

    def _checks(self, insts: list[InstancePlan], rolled_back: bool) -> list[InstancePlan]:
        """Every instance check of `insts` (one command); those that failed (the result failed with them)."""
        plan, result = self.plan, self.result
        units = [unit_of(i) for i in insts]
        requests = [r for i in insts for r in requests_for(plan, i, self.exp)]
        with self.fleet.step(self.run, "checks") as step:
            seen = probe.parse(self.session.run(probe.host_command(units, requests, api_key(plan))).text)
            failed = []
            for inst in insts:
                checks = instance_checks(plan, inst, seen, self.exp)
                result.checks += checks
                bad = [c for c in checks if c.status == "fail"]
                if bad:
                    failed.append(inst)
                    if not rolled_back:
                        result.fail(Status.FAILED, f"{len(bad)} check(s) failed after the start: "
                                    + "; ".join(c.summary for c in bad))
            if failed:
                step.status = StepStatus.FAILED
        return failed

    # -- the SLO gate --------------------------------------------------------------------------------
    def _gate_ready(self) -> bool:
        """Whether this host's batch is the gated one and the host has SLOs (then `self.gate` is its spec), and
        that the workload fits every instance: a bad one fails the host here, before anything stops, instead of
        rolling back instances that serve well."""
        gate = self.opts.slo_gate
        if gate is None or not gate.enabled or gate.batch != self.work.batch:
            return True
        try:
            spec = spec_from_plan(self.plan, gate.overrides)
            if spec.slo.any:
                for inst in self.work.instances:
                    fits(spec, self.plan, inst)
        except DeployError as exc:
            self.result.fail(Status.FAILED, f"SLO gate: {exc.message}",
                             (exc.hint or "fix the bench variables (docs/bench.md)")
                             + "; or roll out without the gate: --no-slo-gate")
            self._undo([], self.work.instances, "the SLO gate's workload was refused; nothing was stopped")
            return False
        self.gate = spec if spec.slo.any else None
        return True

    def _slo_gate(self, insts: list[InstancePlan], spec: BenchSpec) -> list[InstancePlan]:
        """Bench each instance (one after another) against the host's SLOs; those that missed them, the result
        failed as a failed check fails it (the verdicts as evidence). Skipped once the run is stopped: the
        rollout then says the instances were not verified."""
        gate = self.opts.slo_gate
        assert gate is not None
        result, failed = self.result, []
        for inst in insts:
            if self.fleet.abort.is_set():
                break
            made = bench_instance(self.fleet, self.run, self.plan, inst, spec, gate.save_dir)
            result.checks += [bench_check(made), *(v.check(inst.unit) for v in made.verdicts)]
            if made.ok:
                continue
            failed.append(inst)
            missed = [v.summary for v in made.verdicts if not v.ok] or [made.message]
            result.evidence += [f"SLO gate, {inst.unit}: {line}" for line in missed]
            if made.saved:
                result.evidence.append(f"SLO gate, {inst.unit}: vLLM's result saved as {made.saved}")
            undone = "it was rolled back" if self.work.revertible and self.opts.rollback else \
                "it was kept as it is (nothing to roll back to)" if not self.work.revertible else \
                "it was kept (--no-rollback)"
            result.fail(Status.FAILED, f"SLO gate: {inst.unit} {made.status} ({made.message}): " + "; ".join(missed),
                        f"the canary batch must meet the SLOs before the rollout goes on, and {undone}: find the "
                        "cause (load, TP, max_num_seqs; `ernie-deploy bench` measures it again) or adjust the "
                        "vllm_slo_* variables; --no-slo-gate rolls out without the gate (an emergency)")
        return failed

    # -- undo ----------------------------------------------------------------------------------------
    def _undo(self, failed: list[InstancePlan], later: list[InstancePlan], why: str | None,
              restart: bool = True) -> None:
        """Restore what ran before for `failed` (and, with `restart`, start and re-verify it) and give `later`
        (staged, not reached) their files back. The host stays failed either way; the result says what was
        done. An error while undoing is reported beside the original failure, never instead of it."""
        work, result, rollbacks = self.work, self.result, self.change.rollbacks
        if why:
            result.evidence.append(why)
        if not work.revertible:
            return
        if not self.opts.rollback:
            if failed:
                rollbacks.append("kept as it failed (--no-rollback): "
                                 + ", ".join(unit_of(i) for i in failed))
            return
        back = {unit_of(i): work.undo_to[unit_of(i)] for i in failed + later if unit_of(i) in work.undo_to}
        stop = tuple(unit_of(i) for i in failed if unit_of(i) in back)
        disable = tuple(unit_of(i) for i in failed if unit_of(i) not in back)
        if not (back or disable):
            return
        cause = (result.status, result.message, result.hint)
        t0 = self.timeline.now()
        try:
            # Its span: the units with nothing to go back to, stopped and disabled (the restored ones are drawn
            # by their readiness watch).
            with self._phase("roll back", "rollback", disable) as step:
                # The release that failed to start gets marked on the host (`releases`, rollback's --force).
                mark = (self.change.release, releases.failure([unit_of(i) for i in failed], result.message)) \
                    if failed and self.change.release else None
                self.session.run(releases.undo_command(back, stop, disable, self.audit("rollback"), mark))
                step.changed = True
                unpended = [u for u in back if u not in stop]
                if unpended:
                    step.evidence.append("files put back (never restarted): " + ", ".join(unpended))
            if disable:
                rollbacks.append(f"{', '.join(disable)}: no earlier release to go back to (first deploy): "
                                 "stopped and disabled instead of crash-looping")
            if stop and not restart:
                rollbacks.append(f"{', '.join(stop)}: files restored to what ran before; not started (its "
                                 "GPUs are held)")
            elif stop:
                self._restart_restored([i for i in failed if unit_of(i) in stop], back, t0)
        except DeployError as exc:
            rollbacks.append(f"rolling back failed: {exc.message}")
        finally:
            result.status, result.message, result.hint = cause

    def _restart_restored(self, failed: list[InstancePlan], back: dict[str, releases.Release], t0: float) -> None:
        rollbacks = self.change.rollbacks
        restored: list[tuple[InstancePlan, releases.Release]] = []
        for release in {back[unit_of(i)].id: back[unit_of(i)] for i in failed}.values():
            self.timeline.mark("rollback", f"{self.plan.name}: back to {release.id}")
            mine = [i for i in failed if back[unit_of(i)].id == release.id]
            restored += [(i, release) for i in released_instances(self.session, release, self.plan, mine)]
        insts = [i for i, _ in restored]
        if not self._gpus_free(insts).free:
            rollbacks.append(f"{', '.join(unit_of(i) for i in insts)}: files restored, but not started: "
                             "its GPUs were not released")
            return
        launched = self._start(insts, first=False)
        self.started_at = t0
        still = self._ready(insts, launched, rolled_back=True)
        for inst, release in restored:
            verdict = "ready and verified" if inst not in still else \
                "started, not verified (interrupted)" if self.fleet.abort.is_set() else "failed again"
            unit = unit_of(inst)
            if inst not in still and unit in self.pulled:
                how = [x for x, owed in (("post-ready", unit in self.hooked),
                                         ("set ready on its balancer", unit in self.drained)) if owed]
                returned = self._back_in_rotation([inst])
                owing = [x for x, owed in (("post-ready", unit in self.hooked),
                                           ("its balancer", unit in self.drained)) if owed]
                verdict += f"; back in the load balancer ({', '.join(how)})" if returned else \
                    f"; {' and '.join(owing)} failed: still out of the load balancer"
            rollbacks.append(f"{unit_of(inst)}: rolled back to release {release.id}: {verdict}")


def stray_processes(session: Transport, plan: HostPlan, insts: Sequence[InstancePlan],
                    managed: Sequence[str] = ()) -> list[tuple[str, int]]:
    """("host unit: why", PID) for each process on the GPUs of `insts` that belongs to no managed unit (the plan's
    instances and `managed`): once the instance is stopped, vLLM's free-memory check fails its start, so it must
    be found before the stop. Only a process the host's `ps` lists is named: nvidia-smi in a container may list
    the host's PIDs, which say nothing about this host."""
    if not insts:
        return []
    try:
        reading = rolling.parse_gpus(session.run(rolling.gpu_command([unit_of(i) for i in insts])).text)
    except CheckInputError as exc:
        raise RemoteError(Failure.COMMAND, f"nvidia-smi output unusable: {exc.message}", where=plan.name) from None
    ours = {unit_of(i) for i in plan.instances} | set(managed)
    by_uuid = {r.uuid: r.index for r in reading.rows}
    out = []
    for inst in insts:
        for app in reading.apps:
            gpu = by_uuid.get(app.gpu_uuid)
            if gpu in inst.gpus and app.pid in reading.names and reading.units.get(app.pid) not in ours:
                name = reading.names[app.pid]
                used = f"{app.used_memory_mib:.0f} MiB" if app.used_memory_mib is not None else "memory"
                owner = reading.units.get(app.pid)
                out.append((f"{plan.name} {unit_of(inst)}: PID {app.pid}" + (f" ({name})" if name else "")
                            + f" holds {used} on its GPU {gpu}" + (f" (from {owner})" if owner else "")
                            + ", outside every managed unit", app.pid))
    return out


def put_back(fleet: Fleet, run: HostRun[Any], plan: HostPlan, serving: Callable[[str], bool],
             rotation: hooks.Rotation, opts: CycleOptions) -> None:
    """The host's instances out of rotation from an earlier run (its resume state), each that serves now
    (`serving(unit)`): set ready on every balancer fronting it, and post-ready. The others, and those whose
    balancer or hook failed, stay recorded (and named) until they are back."""
    lb = opts.balancers
    for unit in rotation.out_of(plan.name):
        inst = next((i for i in plan.instances if unit_of(i) == unit), None)
        fronted = lb.fronting(plan.name, inst.index) if lb is not None and inst is not None else []
        if inst is None or not (fronted or opts.post_ready) or not serving(unit):
            continue
        back = True
        if lb is not None and fronted:
            fleet.progress(plan.name, f"balancer: {inst.unit} ready (out of rotation since an earlier run)")
            with fleet.step(run, f"balancer set ready {inst.unit} (back in rotation)") as step:
                problems = lb.set_state(plan.name, inst.index, "ready")
                step.changed = True
                step.evidence = problems or [f"{inst.unit}: set ready on {', '.join(fronted)}"]
                if problems:
                    step.status, back = StepStatus.FAILED, False
                    run.result.evidence.append(f"{inst.unit}: still drained on its balancer: " + "; ".join(problems))
        if opts.post_ready:
            fleet.progress(plan.name, f"post-ready hook for {inst.unit} (out of rotation since an earlier run)")
            with fleet.step(run, f"post-ready hook {inst.unit} (back in rotation)") as step:
                done = hooks.run("post-ready", opts.post_ready,
                                 hooks.environment("post-ready", opts.command, plan, inst, 0), opts.hook_timeout)
                step.evidence = [done.summary, *done.output]
                if not done.ok:
                    step.status, back = StepStatus.FAILED, False
        if back:
            rotation.back(plan.name, unit)
