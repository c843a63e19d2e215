"""`watch`: the progress check (checks/progress.py) repeated over the selected hosts for a bounded time, and with
`restart_stalled` the watchdog's remediation (docs/watch.md).

Each round reads every host through the fleet, hosts in parallel: the facts (is each unit active) and one
progress reading of all its instances (orchestration/progress.py: two /metrics readings a window apart). Rounds
start every `every` seconds from the first; none starts once `seconds` have passed, except the one round that
follows a restart (it judges the restarted instance), so a watch ends within `seconds` plus one round, plus the
restart in progress when the time ran out.

Remediation restarts a stalled or stuck instance through the same cycle as `ernie-deploy restart --instance`
(orchestration/restart.py: lock, pre-flight, drain on the balancers, stop, GPU release, start, readiness gate,
SLO gate, rollback on failure, audit), with these rules:
* one instance at a time, and at most one per round, so the next round sees what a restart did before another;
* never the last serving instance of a model: another instance serving the same served model name must have been
  healthy (active, progress ok or idle) in the same round, among the hosts this watch reads; otherwise the
  instance is named "not restarted: the last serving instance of MODEL" with the fix;
* at most `max_restarts` restarts per instance per watch: one that stays sick after them is reported, not
  restarted again (a restart loop would hide the cause).

The end state is the last round's: exit 2 when an instance read in it is stalled, stuck, unreadable or not
active, or when a restart of this watch failed; 4 when a host was unreachable in it; a signal ends the watch
at once (a restart in progress finishes its cycle first, as restart's does, so no instance is left drained).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.checks.deaths import Story
from ernie_deploy.checks.progress import HUNG, Progress, Thresholds, thresholds_of
from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.bench import SloGate
from ernie_deploy.orchestration.cycle import CycleOptions, unit_of
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.progress import read_progress
from ernie_deploy.orchestration.restart import Restarter, RestartOptions
from ernie_deploy.orchestration.results import HostResult, Status, exit_code
from ernie_deploy.orchestration.rollout import RolloutOptions
from ernie_deploy.orchestration.snapshot import SnapshotOptions, take
from ernie_deploy.orchestration.transport import Progress as ShowProgress
from ernie_deploy.orchestration.transport import RemoteHost, Transport
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.playbook.actions import ACTIONS, watch_problem
from ernie_deploy.remote.converge import RUNNING, death_story

_TASK = ACTIONS["watch"].args  # the command line and the playbook task share these defaults
UNHEALTHY_RESTARTABLE = HUNG  # what a restart can clear; unreadable or down needs a person
MAX_RESTARTS_LIMIT = 10

# What reads one host's progress (orchestration/progress.py's read_progress; tests inject a scripted one).
Reader = Callable[[Transport, HostPlan, Thresholds], dict[str, Progress]]


@dataclass(frozen=True)
class WatchOptions:
    seconds: float = float(_TASK["for"].default)  # how long to keep starting rounds
    every: float = float(_TASK["every"].default)  # between the starts of two rounds
    once: bool = False  # one round (and the round after a restart)
    restart_stalled: bool = False
    max_restarts: int = 1  # per instance per watch
    # The restart of one instance (its cycle, balancers, SLO gate, command label); `instance` is set per restart.
    restart: RestartOptions = field(default_factory=lambda: restart_options("ernie-deploy watch --restart-stalled"))

    def check(self) -> None:
        """Bad bounds are bad input: said before any host is contacted."""
        problem = watch_problem(self.seconds, self.every)
        if problem is not None:
            raise DeployError(f"--{problem[0]} {problem[1]}", hint=problem[2])
        if not 1 <= self.max_restarts <= MAX_RESTARTS_LIMIT:
            raise DeployError(f"--max-restarts must be 1 to {MAX_RESTARTS_LIMIT}, got {self.max_restarts}",
                              hint="1 (the default): a restart that did not help will not help a second time")

    def max_rounds(self) -> int:
        """The hard bound on rounds: every scheduled start within `seconds`, and one after the last restart."""
        return 1 if self.once else int(self.seconds // self.every) + 1


@dataclass(frozen=True)
class Seen:
    """One instance as one round read it."""

    host: str
    unit: str  # the systemd unit, "ernie-vllm-0.service"
    model: str  # its served model name
    active: bool  # systemd says active (or activating, reloading)
    progress: Progress
    death: Story | None = None  # how its engine last died and what followed (checks/deaths.py)

    @property
    def key(self) -> tuple[str, str]:
        return self.host, self.unit

    @property
    def state(self) -> str:
        """The progress state, or "down" for a unit systemd does not run."""
        return self.progress.state if self.active else "down"

    @property
    def healthy(self) -> bool:
        return self.active and self.progress.healthy()

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "unit": self.unit, "model": self.model, "active": self.active,
                "state": self.state, "healthy": self.healthy, "progress": self.progress.to_json(),
                "death": self.death.to_json() if self.death else None}


@dataclass
class Decision:
    """What the watchdog did about one sick instance in one round: restarted (the cycle succeeded), failed (the
    cycle failed; its result says what was rolled back), interrupted (a signal stopped the cycle cleanly), or
    not-restarted (why, and the fix)."""

    round: int
    host: str
    unit: str
    model: str
    outcome: str  # restarted | failed | interrupted | not-restarted
    message: str
    fix: str | None = None
    result: HostResult | None = None  # the restart's own result (steps, rollbacks), when one ran

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "host": self.host, "unit": self.unit, "model": self.model,
                "outcome": self.outcome, "message": self.message, "fix": self.fix}


@dataclass
class Round:
    number: int
    at: float  # seconds since the watch started
    seen: list[Seen] = field(default_factory=list)
    hosts: list[HostResult] = field(default_factory=list)  # each host's read: ok, or why it was not read
    decisions: list[Decision] = field(default_factory=list)

    @property
    def sick(self) -> list[Seen]:
        return [s for s in self.seen if not s.healthy]


@dataclass
class WatchReport:
    options: WatchOptions
    rounds: list[Round] = field(default_factory=list)
    ended: str = ""  # why it ended: "time up", "once", "interrupted"
    stopped_by: int | None = None
    results: list[HostResult] = field(default_factory=list)  # the end state per host (the exit code's input)

    @property
    def decisions(self) -> list[Decision]:
        return [d for r in self.rounds for d in r.decisions]

    @property
    def restarts(self) -> list[Decision]:
        return [d for d in self.decisions if d.outcome != "not-restarted"]

    @property
    def code(self) -> int:
        return exit_code(self.results, self.stopped_by)


class WatchView:
    """What the watch shows as it goes; the command line shows rounds and restarts, a playbook task nothing."""

    def reading(self, number: int) -> AbstractContextManager[ShowProgress | None]:
        """Around a round's read: the progress display for its hosts (None: none)."""
        return nullcontext(None)

    def restarting(self, host: str, unit: str) -> AbstractContextManager[ShowProgress | None]:
        return nullcontext(None)

    def round_done(self, done: Round) -> None:
        """A round was read and its decisions taken (restarts included)."""


def restart_options(command: str, cycle: CycleOptions | None = None, *, forks: int = 5, lock_wait: float = 0.0,
                    known_hosts: tuple[str, ...] = (), templates: Path | None = None,
                    balancer_hosts: tuple[str, ...] = (), slo_gate: SloGate | None = None) -> RestartOptions:
    """How the watchdog restarts one instance: as `ernie-deploy restart --instance` does (pre-flight, the cycle,
    the SLO gate), labelled `command` in the audit log; hooks see the operation `restart`."""
    return RestartOptions(mode="restart", forks=forks, lock_wait=lock_wait, known_hosts=known_hosts, command=command,
                          templates=templates,
                          cycle=dataclasses.replace(cycle or CycleOptions(), command="restart", slo_gate=slo_gate),
                          rollout=RolloutOptions(preflight=True, command="restart", balancer_hosts=balancer_hosts,
                                                 slo_gate=slo_gate))


class Watcher:
    def __init__(self, ctx: PlanContext, fleet: Fleet, options: WatchOptions, *, reader: Reader | None = None,
                 view: WatchView | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] | None = None) -> None:
        """`fleet`: every round's reads and every restart run on it (one abort, one signal). `sleep(s)` waits
        between rounds (default: the fleet's abort event, so a signal ends the wait at once)."""
        self.ctx, self.fleet, self.options = ctx, fleet, options
        self.reader = reader or read_progress
        self.view = view or WatchView()
        self.clock = clock
        self.sleep: Callable[[float], object] = sleep or fleet.abort.wait
        self.templates = unit_environment(options.restart.templates)
        self.restarted: dict[tuple[str, str], int] = {}  # instance → restarts made by this watch
        self.report = WatchReport(options)

    def run(self, hosts: Sequence[RemoteHost]) -> WatchReport:
        self.options.check()
        thresholds = {h.name: thresholds_of(h.name, h.vars) for h in hosts}  # bad values: before any host
        opts, report = self.options, self.report
        start = self.clock()
        deadline = start + opts.seconds
        limit = opts.max_rounds() + 1
        with self.fleet.signals():
            # A hard bound besides the clock (a clock that does not advance cannot make it endless): the rounds the
            # schedule allows and one that judges a restart; the last round a bound allows restarts nothing.
            for number in range(1, limit + 1):
                done = self._round(number, start, hosts, thresholds)
                report.rounds.append(done)
                final = number == limit or (opts.once and number > 1)
                restarted = opts.restart_stalled and self.fleet.signal is None and \
                    self._remediate(done, hosts, start if final else deadline)
                self.view.round_done(done)
                if self.fleet.signal is not None:
                    break
                if restarted:
                    continue  # the next round at once: it judges the restart (also once the time is up)
                next_at = start + number * opts.every
                if opts.once or max(next_at, self.clock()) >= deadline:
                    report.ended = "once" if opts.once else "time up"
                    break
                self.sleep(max(0.0, next_at - self.clock()))
                if self.fleet.signal is not None:
                    break
            else:
                report.ended = "time up"
        if self.fleet.signal is not None:
            report.ended = "interrupted"
        report.stopped_by = self.fleet.signal
        report.results = end_state(report)
        return report

    # -- one round ----------------------------------------------------------------------------------------------
    def _round(self, number: int, start: float, hosts: Sequence[RemoteHost],
               thresholds: dict[str, Thresholds]) -> Round:
        done = Round(number, round(self.clock() - start, 3))

        def read(run: HostRun[None]) -> None:
            snap = take(self.fleet, run, self.ctx, self.templates, SnapshotOptions(render=False))
            if snap is None:
                return
            assert run.session is not None
            self.fleet.progress(run.host.name, f"round {number}: reading progress")
            with self.fleet.step(run, "progress"):
                found = self.reader(run.session, snap.plan, thresholds[run.host.name])
            seen = []
            for inst in snap.plan.instances:
                unit = unit_of(inst)
                state = snap.facts.units.get(unit)
                judged = found.get(inst.unit)
                if judged is None:  # the reader answers for every planned instance; never count one healthy
                    judged = Progress("unreadable", "no progress reading came back for it",
                                      f"ernie-deploy status -i INV --limit {run.host.name} shows its state", None, None)
                seen.append(Seen(run.host.name, unit, inst.served_model_name,
                                 state is not None and state.active_state in RUNNING, judged,
                                 death_story(unit, snap.facts, f"ernie-deploy deploy -i INV --limit {run.host.name}")))
            sick = [s for s in seen if not s.healthy]
            run.result.message = (f"{len(sick)} of {len(seen)} instance(s) not making progress" if sick
                                  else f"all {len(seen)} instance(s) making progress or idle")
            done.seen.extend(seen)

        with self.view.reading(number) as show:
            if show is not None:
                self.fleet.progress = show
            runs = self.fleet.run(hosts, [read])
        done.hosts = [r.result for r in runs]
        done.seen.sort(key=lambda s: s.key)
        return done

    # -- remediation --------------------------------------------------------------------------------------------
    def _remediate(self, done: Round, hosts: Sequence[RemoteHost], deadline: float) -> bool:
        """Decide about each stalled or stuck instance of the round; restart at most one. True when one ran."""
        by_name = {h.name: h for h in hosts}
        ran = False
        for sick in (s for s in done.seen if s.active and s.progress.state in UNHEALTHY_RESTARTABLE):
            decision = self._refusal(done, sick, ran, deadline)
            if decision is None:
                decision = self._restart(done.number, sick, by_name[sick.host])
                ran = True
            done.decisions.append(decision)
            if self.fleet.signal is not None:
                break
        return ran

    def _refusal(self, done: Round, sick: Seen, ran: bool, deadline: float) -> Decision | None:
        """Why `sick` is not restarted now, or None when it may be."""
        def no(message: str, fix: str | None = None) -> Decision:
            return Decision(done.number, sick.host, sick.unit, sick.model, "not-restarted", message, fix)

        made = self.restarted.get(sick.key, 0)
        by_hand = f"ernie-deploy restart -i INV --limit {sick.host} --instance {sick.unit}"
        if made >= self.options.max_restarts:
            return no(f"not restarted again: restarted {made} time(s) in this watch (at most "
                      f"{self.options.max_restarts}), and it is {sick.state} again",
                      f"a restart does not clear it: read why in its journal (ernie-deploy logs -i INV {sick.host} "
                      f"--instance {sick.unit}), then {by_hand}")
        if ran:
            return no("waits: one restart per round, and the next round judges the one just made")
        if self.clock() >= deadline:
            return no("not restarted: the watch's time is up", f"{by_hand}, or watch longer (--for)")
        peers = [s for s in done.seen if s.model == sick.model and s.key != sick.key and s.healthy]
        if not peers:
            return no(f"not restarted: the last serving instance of {sick.model} (no other instance of it was "
                      "healthy in this round, among the hosts watched); restarting it would leave the model "
                      "with no capacity",
                      f"bring up or repair another instance serving {sick.model} (a --limit that leaves out its "
                      f"host hides it from the watch), or accept the outage: {by_hand}")
        return None

    def _restart(self, number: int, sick: Seen, host: RemoteHost) -> Decision:
        opts = dataclasses.replace(self.options.restart, instance=sick.unit)
        self.restarted[sick.key] = self.restarted.get(sick.key, 0) + 1
        restarter = Restarter(self.ctx, self.fleet.connector, opts, fleet=self.fleet)
        with self.view.restarting(sick.host, sick.unit) as show:
            if show is not None:
                self.fleet.progress = show
            (result,) = restarter.run([host])
        if result.status is Status.CHANGED:
            outcome = "restarted"
        elif self.fleet.signal is not None:
            outcome = "interrupted"  # the cycle stopped cleanly: the instance serves, or its result says why not
        else:
            outcome = "failed"
        return Decision(number, sick.host, sick.unit, sick.model, outcome, result.message, result.hint, result)


def end_state(report: WatchReport) -> list[HostResult]:
    """Each host as the watch ends: its read in the last round, failed when an instance of it was not healthy
    then or a restart of this watch failed on it."""
    if not report.rounds:
        return []
    last = report.rounds[-1]
    failed = {d.host: d for d in report.decisions if d.outcome == "failed"}
    out = []
    for read in last.hosts:
        result = HostResult(read.host, read.status, read.message, read.hint, findings=list(read.findings))
        sick = [s for s in last.sick if s.host == read.host]
        if read.status is Status.OK and sick:
            first = sick[0]
            result.fail(Status.FAILED, f"{len(sick)} instance(s) not healthy at the end: "
                        + ", ".join(f"{s.unit} {s.state}" for s in sick), first.progress.fix)
        if read.host in failed and read.status is Status.OK:
            why = failed[read.host]
            result.fail(Status.FAILED, (result.message + "; " if sick else "")
                        + f"the restart of {why.unit} failed: {why.message}", why.fix or result.hint)
        out.append(result)
    return out
