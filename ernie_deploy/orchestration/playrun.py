"""`run`: a playbook's plays in order; each task is one of the toolkit's operations over the play's hosts.

Like ansible-playbook, a play runs its tasks one after the other across all its hosts, and a host that
fails a task is left out of every later task and play. `any_errors_fatal` ends the run at the first
failure, `max_fail_percentage` once more than that share of the play's hosts failed. A play's `serial`,
`canary` and `max_fail_percentage` shape the batches of its rolling tasks (the other tasks are quick and
change nothing that serves, or stage only). Each task takes and releases the deploy lock on its own, and a
signal stops the run after the task in progress has stopped cleanly.

The inventory's balancers (group vllm_balancers, docs/balancer.md) are planned once per run from every vLLM
host (`RunOptions.balancer_plans`, cli/run.py). Every rolling and restart task drives them around each restart
as `restart` does (drain, wait for no sessions, ready once it serves). A play's own tasks work on its vLLM hosts;
the balancer hosts its pattern matches are worked on only by its converge and rolling (not `always`) tasks, the
ones that change files as `deploy` does: they apply those balancers' configuration first, and one that fails
ends the run with no vLLM host touched, as it stops `deploy`.

A `bench` task benches each instance as `ernie-deploy bench` does (the hosts' vllm_bench_* workload and vllm_slo_*
SLOs, the task's `workload:` and `slo:` over them); with `gate: false` an SLO missed is a warning, not a failure.
Rolling and restart tasks gate their canary batch on the SLOs (`slo_gate`, default true) as deploy does.

A `watch` task is `ernie-deploy watch` over the play's hosts (orchestration/watch.py): each host's result is its
end state (failed when an instance of it is not healthy at the end, or a restart of it failed; changed when the
watchdog restarted one), with its instances' last progress and every restart decision as evidence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.errors import DeployError
from ernie_deploy.inventory.inventory import Host, Inventory
from ernie_deploy.inventory.resolve import with_vars
from ernie_deploy.orchestration import audit, hooks
from ernie_deploy.orchestration.balancers import BalancerControl, Balancers
from ernie_deploy.orchestration.bench import OK, BenchRunner, SloGate, measured
from ernie_deploy.orchestration.cycle import CycleOptions, unit_of
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.details import ProvisionReport
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.provision import Provisioner, ProvisionOptions
from ernie_deploy.orchestration.restart import Restarter, RestartOptions
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.rollout import Report, RolloutOptions
from ernie_deploy.orchestration.snapshot import SnapshotOptions, down, take
from ernie_deploy.orchestration.transport import Connector, Progress
from ernie_deploy.orchestration.verify import KINDS, Verifier
from ernie_deploy.orchestration.watch import Watcher, WatchOptions, restart_options
from ernie_deploy.planning.balancer import GROUP, BalancerPlan, render_balancer, split_hosts
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.provisioning import parse_rate
from ernie_deploy.planning.render import unit_environment
from ernie_deploy.playbook.actions import ACTIONS
from ernie_deploy.playbook.schema import Play, Playbook, Task, bench_overrides, verify_expectations
from ernie_deploy.remote import lock, shelltask

BAD = (Status.FAILED, Status.UNREACHABLE, Status.LOCKED)
# The task starts: the caller shows its header and returns the progress display for its hosts.
StartTask = Callable[[Play, Task, Sequence[Host]], AbstractContextManager[Progress]]


@dataclass(frozen=True)
class RunOptions:
    base_dir: Path  # the inventory's directory (provisioning's relative sources)
    check: bool = False
    diff: bool = False
    forks: int = 5
    lock_wait: float = 0.0
    known_hosts: tuple[str, ...] = ()
    templates: Path | None = None
    limit: str | None = None
    command: str = "ernie-deploy run"
    wait_poll: float = 2.0  # seconds between a wait_ready task's polls
    # The inventory's balancers: their names (a rollout says whether it drove them), their plans (from every
    # vLLM host of the inventory, whatever --limit selects) and what drives them around each restart. No plans
    # and no control: none in the inventory, or --no-balancer (nothing is applied or driven then).
    balancer_hosts: tuple[str, ...] = ()
    balancer_plans: tuple[BalancerPlan, ...] = ()
    balancers: BalancerControl | None = None


@dataclass
class TaskRun:
    play: str
    task: Task
    results: list[HostResult] = field(default_factory=list)
    note: str = ""  # why it did not run (check mode, no hosts left)
    report: Report | None = None  # a rolling task's batches


class PlaybookRunner:
    def __init__(self, inventory: Inventory, ctx: PlanContext, connector: Connector, options: RunOptions,
                 start_task: StartTask, finished: Callable[[TaskRun], None] = lambda rec: None,
                 confirm: Callable[[str], bool] | None = None) -> None:
        self.inventory, self.ctx, self.connector, self.options = inventory, ctx, connector, options
        self.start_task, self.finished = start_task, finished
        self.confirm = confirm
        self.tasks: list[TaskRun] = []
        self.stopped_by: int | None = None
        self.ended: str | None = None  # why the run ended early (any_errors_fatal, max_fail_percentage)
        self._balancer_hosts: list[Host] = []  # the balancer hosts the task in progress applies first

    def run(self, book: Playbook) -> list[TaskRun]:
        failed: set[str] = set()
        limited = {h.name for h in self.inventory.select(self.options.limit)} if self.options.limit else None
        planned = {p.host for p in self.options.balancer_plans}
        for play in book.plays:
            vllm, matched = split_hosts(self.inventory.select(play.hosts))
            hosts = [self._with_vars(h, play) for h in vllm if limited is None or h.name in limited]
            # Balancer hosts keep the inventory's variables: their plan was made once for the run.
            matched = [h for h in matched if limited is None or h.name in limited]
            lbs = [h for h in matched if h.name in planned]
            failed_here: set[str] = set()
            for task in play.tasks:
                live = [h for h in hosts if h.name not in failed]
                self._balancer_hosts = [h for h in lbs if h.name not in failed] if applies_balancers(task) else []
                record = TaskRun(play.name, task)
                self.tasks.append(record)
                if not live and not self._balancer_hosts:
                    record.note = self._idle(task, hosts, lbs, vllm, matched)
                    self.finished(record)
                    continue
                self._task(play, task, live, record)
                self.finished(record)
                bad = {r.host for r in record.results if r.status in BAD}
                failed |= bad
                failed_here |= bad
                if self.stopped_by is not None:
                    return self.tasks
                lb_bad = sorted(bad & {h.name for h in self._balancer_hosts})
                if lb_bad and not self.options.check:
                    # A balancer fronts every instance: the task left them all untouched, later tasks must too.
                    self.ended = (f"play {play.name!r}: the configuration of balancer {', '.join(lb_bad)} failed "
                                  f"(its result says why), so no vLLM host was touched and the run stops here")
                    return self.tasks
                if bad and play.any_errors_fatal:
                    self.ended = f"play {play.name!r}: {', '.join(sorted(bad))} failed and any_errors_fatal is set"
                    return self.tasks
                mfp, members = play.max_fail_percentage, len(hosts) + len(lbs)
                if mfp is not None and members and 100.0 * len(failed_here) / members > mfp:
                    self.ended = (f"play {play.name!r}: {len(failed_here)} of {members} host(s) failed, more "
                                  f"than max_fail_percentage {mfp:g}%")
                    return self.tasks
        return self.tasks

    @staticmethod
    def _idle(task: Task, hosts: list[Host], lbs: list[Host], vllm: list[Host], matched: list[Host]) -> str:
        """Why a task has no host to work on. `matched`: the play's balancer hosts in --limit, `lbs` those of
        them the run planned."""
        if hosts or (lbs and applies_balancers(task)):
            return "no hosts left"
        if lbs:
            return (f"the play has only balancer hosts here ({GROUP}): only its converge and rolling tasks work "
                    "on them (they apply their configuration)")
        if matched and not vllm:
            return f"the play's hosts are balancers ({GROUP}), which this run leaves alone (--no-balancer)"
        return "no host of the play is in --limit"

    @staticmethod
    def _with_vars(host: Host, play: Play) -> Host:
        # Play vars override the inventory's and yield to -e, as in Ansible (play vars rank above inventory
        # host_vars, extra vars above everything).
        return dataclasses.replace(host, vars=with_vars(host.vars, play.vars)) if play.vars else host

    def _task(self, play: Play, task: Task, hosts: list[Host], record: TaskRun) -> None:
        if self.options.check and not ACTIONS[task.action].runs_in_check:
            record.note = "skipped in check mode"
            return
        with self.start_task(play, task, [*self._balancer_hosts, *hosts]) as progress:
            fleet = Fleet(self.connector, FleetOptions(self.options.forks, play.any_errors_fatal,
                                                       self.options.known_hosts), progress)
            HANDLERS[task.action](self, play, task, hosts, record, fleet)
            if self.stopped_by is None:
                self.stopped_by = fleet.signal

    # -- the actions -------------------------------------------------------------------------------------
    def _provision(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        opts = ProvisionOptions(base_dir=self.options.base_dir, check=self.options.check,
                                verify_files=task.flag("verify_files"),
                                rate=parse_rate(task.text("bwlimit")), lock_wait=self.options.lock_wait,
                                command=self._label(task))
        runs = Provisioner(self.ctx, opts, fleet).run(hosts)
        for r in runs:
            actions = r.result.detail_of(ProvisionReport).actions
            r.result.evidence += [action_line(a) for a in actions]
        record.results = [r.result for r in runs]

    def _deploy(self, task: Task, fleet: Fleet, *, check: bool, activate: bool, rollout: RolloutOptions,
                cycle: CycleOptions, health_timeout: float = 0.0, prune: bool = False,
                setup: Balancers | None = None) -> Runner:
        options = Options(check=check, diff=self.options.diff, prune=prune,
                          forks=self.options.forks, lock_wait=self.options.lock_wait, health_timeout=health_timeout,
                          known_hosts=self.options.known_hosts, command=self._label(task),
                          templates=self.options.templates, cycle=cycle, rollout=rollout, activate=activate,
                          balancer_setup=setup, render_balancer=render_balancer if setup is not None else None)
        return Runner(self.ctx, self.connector, options, fleet=fleet)

    @contextlib.contextmanager
    def _setup(self, fleet: Fleet) -> Iterator[Balancers | None]:
        """The balancers the task applies first (None: none), over the task's fleet; their sessions end with it."""
        names = {h.name for h in self._balancer_hosts}
        chosen = [p for p in self.options.balancer_plans if p.host in names]
        if not chosen:
            yield None
            return
        setup = Balancers(fleet, chosen, {h.name: h for h in self._balancer_hosts})
        try:
            yield setup
        finally:
            setup.close()

    def _plan(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        runner = self._deploy(task, fleet, check=True, activate=False, rollout=RolloutOptions(),
                              cycle=CycleOptions())
        record.results = runner.run(hosts)
        for r in record.results:
            if r.status is Status.CHANGED:  # a plan is read-only: what deploy would do is news, not a change
                r.status, r.message = Status.OK, "plan ok; " + r.message.replace(" (check mode: nothing was touched)",
                                                                                  "")

    def _converge(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        with self._setup(fleet) as setup:
            runner = self._deploy(task, fleet, check=self.options.check, activate=False, rollout=RolloutOptions(),
                                  cycle=CycleOptions(), prune=task.flag("prune"), setup=setup)
            record.results = runner.run(hosts)

    def _rolling(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet,
                 batches: bool = True) -> None:
        gate = SloGate(enabled=task.flag("slo_gate"))  # one object: the rollout names the batch its cycles gate
        rollout = RolloutOptions(serial=play.serial if batches else None, canary=play.canary if batches else 0,
                                 max_fail_percentage=play.max_fail_percentage, force=task.flag("force"),
                                 preflight=True, command=self._label(task),
                                 balancer_hosts=self.options.balancer_hosts, slo_gate=gate)
        budget = task.number("startup_budget")
        # Hooks are told which operation this is, as docs/hooks.md lists them (the audit log gets the label).
        cycle = CycleOptions(command="restart" if task.flag("always") else "deploy", pre_drain=task.text("pre_drain"),
                             post_ready=task.text("post_ready"), hook_timeout=task.number("hook_timeout"),
                             idle_timeout=task.number("idle_timeout"), gpu_timeout=task.number("gpu_release_timeout"),
                             parallel_instances=task.flag("parallel_instances"), rollback=task.flag("rollback"),
                             health_timeout=budget, balancers=self.options.balancers,
                             balancer_plans=self.options.balancer_plans, slo_gate=gate)
        if task.flag("always"):
            options = RestartOptions(mode="restart", instance=task.text("instance"), check=self.options.check,
                                     forks=self.options.forks, lock_wait=self.options.lock_wait,
                                     known_hosts=self.options.known_hosts, command=self._label(task),
                                     templates=self.options.templates, cycle=cycle, rollout=rollout)
            restarter = Restarter(self.ctx, self.connector, options, fleet=fleet)
            record.results, record.report = restarter.run(hosts), restarter.report
            return
        with self._setup(fleet) as setup:
            runner = self._deploy(task, fleet, check=self.options.check, activate=True, rollout=rollout, cycle=cycle,
                                  health_timeout=budget, setup=setup)
            record.results, record.report = runner.run(hosts), runner.report

    def _restart(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        self._rolling(play, task, hosts, record, fleet, batches=False)

    def _wait_ready(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        timeout = task.number("timeout")
        templates = unit_environment(self.options.templates)

        def wait(run: HostRun[None]) -> None:
            deadline = time.monotonic() + timeout
            while True:
                snap = take(fleet, run, self.ctx, templates, SnapshotOptions(render=False))
                if snap is None:
                    return
                problems = down(run.host.name, snap, [unit_of(i) for i in snap.plan.instances], installed_only=False)
                if not problems:
                    run.result.message = f"all {len(snap.plan.instances)} instance(s) serving"
                    return
                if time.monotonic() >= deadline or fleet.abort.is_set():
                    run.result.fail(Status.FAILED, f"not serving after {timeout:.0f}s: " + "; ".join(problems),
                                    f"ernie-deploy logs -i INV {run.host.name} shows the journal")
                    return
                fleet.progress(run.host.name, f"waiting: {problems[0]}")
                fleet.abort.wait(self.options.wait_poll)

        record.results = [r.result for r in fleet.run(hosts, [wait])]

    def _verify(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet,
                expectations: Expectations | None = None, kinds: Sequence[str] = KINDS) -> None:
        # Check mode started nothing: verify says what it would check instead of failing what never ran.
        verifier = Verifier(self.ctx, self.connector, fleet.options, expectations=expectations or
                            verify_expectations(task), fleet=fleet, check=self.options.check, kinds=kinds)
        record.results = verifier.run(hosts)

    def _gpu_check(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        self._verify(play, task, hosts, record, fleet, Expectations(), kinds=("gpus",))
        for r in record.results:
            if r.status not in (Status.OK, Status.FAILED) or not r.checks:
                continue
            r.checks = [c for c in r.checks if c.name.startswith("gpu")]
            failed = [c for c in r.checks if c.status == "fail"]
            r.status = Status.FAILED if failed else Status.OK
            r.message = (f"{len(failed)} of {len(r.checks)} GPU checks failed" if failed
                         else f"all {len(r.checks)} GPU checks passed")

    def _bench(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        runner = BenchRunner(self.ctx, fleet, overrides=bench_overrides(task), instance=task.text("instance"))
        record.results = runner.run(hosts)
        gate = task.flag("gate")
        for r in record.results:
            benches = runner.reports.get(r.host, [])
            r.evidence += [f"{b.unit}: {b.status}: {measured(b)}" for b in benches]
            r.evidence += [f"{b.unit}: raw result saved as {b.saved}" for b in benches if b.saved]
            if gate or r.status is not Status.FAILED or not benches or fleet.abort.is_set() \
                    or any(b.status not in (OK, "slo-failed") for b in benches):
                continue
            # gate: false: the bench ran everywhere; an SLO missed is reported, not failed.
            r.checks = [dataclasses.replace(c, status="warn") if c.status == "fail" else c for c in r.checks]
            missed = sum(b.status == "slo-failed" for b in benches)
            r.status, r.hint = Status.OK, None
            r.message = f"{len(benches)} instance(s) benched; {missed} missed an SLO (gate: false: reported only)"

    def _hook(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        timeout = task.number("timeout")
        base = {"ERNIE_HOOK": task.name, "ERNIE_COMMAND": "run", "ERNIE_PLAY": play.name,
                "ERNIE_HOSTS": " ".join(h.name for h in hosts)}
        if task.flag("once"):
            outcome = hooks.run(task.name, task.args["run"], base, timeout)
            record.results = [_hook_result(h.name, outcome) for h in hosts]
            return

        def one(run: HostRun[None]) -> None:
            env = {**base, "ERNIE_HOST": run.host.name, "ERNIE_ADDRESS": run.host.address}
            fleet.progress(run.host.name, f"hook {task.name}")
            done = _hook_result(run.host.name, hooks.run(task.name, task.args["run"], env, timeout))
            run.result.status, run.result.message, run.result.evidence = done.status, done.message, done.evidence

        record.results = [r.result for r in fleet.run(hosts, [one])]

    def _pause(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        if "prompt" in task.args:
            ok = self.confirm is not None and self.confirm(str(task.args["prompt"]))
            message = "confirmed" if ok else "not confirmed: the run stops here"
        else:
            seconds = float(task.args["seconds"])
            with fleet.signals():
                fleet.abort.wait(seconds)
            self.stopped_by = fleet.signal
            ok, message = fleet.signal is None, f"paused {seconds:g}s"
        record.results = [HostResult(h.name, Status.OK if ok else Status.FAILED, message) for h in hosts]
        if not ok and self.stopped_by is None:
            self.ended = f"task {task.name!r} was not confirmed"

    def _watch(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        gate = SloGate(enabled=True)  # a watchdog's restart is gated as a restart task's is by default
        restart = restart_options(self._label(task), CycleOptions(balancers=self.options.balancers,
                                                                  balancer_plans=self.options.balancer_plans),
                                  forks=self.options.forks, lock_wait=self.options.lock_wait,
                                  known_hosts=self.options.known_hosts, templates=self.options.templates,
                                  balancer_hosts=self.options.balancer_hosts, slo_gate=gate)
        options = WatchOptions(seconds=task.number("for"), every=task.number("every"),
                               restart_stalled=task.flag("restart_stalled"), restart=restart)
        try:
            report = Watcher(self.ctx, fleet, options).run(hosts)
        except DeployError as exc:  # a bad vllm_progress_* variable (play vars too): said before any host is read
            where = f"{exc.where}: " if exc.where else ""
            record.results = [HostResult(h.name, Status.FAILED, f"not watched: {where}{exc.message}", exc.hint)
                              for h in hosts]
            return
        last = report.rounds[-1].seen if report.rounds else []
        for r in report.results:
            r.evidence += [f"{s.unit}: {s.state} at the end: {s.progress.evidence}" for s in last if s.host == r.host]
            r.evidence += [f"round {d.round}: {d.unit}: {d.outcome}: {d.message}" for d in report.decisions
                           if d.host == r.host]
            if r.status is Status.OK and any(d.host == r.host and d.outcome == "restarted" for d in report.decisions):
                r.status = Status.CHANGED
        record.results = report.results

    def _label(self, task: Task) -> str:
        """What the audit log and hooks see as the command."""
        return f"{self.options.command} ({task.name})"

    def _command(self, play: Play, task: Task, hosts: list[Host], record: TaskRun, fleet: Fleet) -> None:
        timeout = task.number("timeout")
        script = str(task.args["run"])
        who = lock.LockInfo.mine(self._label(task))

        def one(run: HostRun[None]) -> None:
            session = fleet.connect(run)
            fleet.progress(run.host.name, f"running {task.name}")
            with fleet.step(run, "command") as step:
                r = session.run(shelltask.command(script, audit.record(who, run.host.name, "command", run=script),
                                                  timeout))
                step.changed = True
            lines = r.text.strip().splitlines()[-10:]
            if r.code != 0:
                err = r.stderr.decode(errors="replace").strip().splitlines()[-5:]
                run.result.fail(Status.FAILED, f"command exited {r.code}" + (f": {err[-1]}" if err else ""),
                                "see the command's output above; fix it and run again")
                run.result.evidence = lines + err
                return
            run.result.status, run.result.message, run.result.evidence = Status.CHANGED, "command ran", lines

        record.results = [r.result for r in fleet.run(hosts, [one])]


def applies_balancers(task: Task) -> bool:
    """Whether the task applies the configuration of its play's balancer hosts first: the tasks that change
    files as `deploy` does (converge, rolling without `always`); a restart changes no file."""
    return task.action == "converge" or (task.action == "rolling" and not task.flag("always"))


def action_line(action: dict[str, str]) -> str:
    """A provisioning action as a provision task's evidence line."""
    return f"{action['step']}: {action['status']}: {action['detail']}"


def _hook_result(host: str, outcome: hooks.HookResult) -> HostResult:
    status = Status.OK if outcome.ok else Status.FAILED
    return HostResult(host, status, outcome.summary, None if outcome.ok else "fix the hook command and run again",
                      evidence=list(outcome.output))


Handler = Callable[[PlaybookRunner, Play, Task, list[Host], TaskRun, Fleet], None]
# Each registered action's handler (playbook/actions.py declares the actions; a test keeps the two the same).
HANDLERS: dict[str, Handler] = {
    "provision": PlaybookRunner._provision, "plan": PlaybookRunner._plan, "converge": PlaybookRunner._converge,
    "rolling": PlaybookRunner._rolling, "restart": PlaybookRunner._restart, "wait_ready": PlaybookRunner._wait_ready,
    "verify": PlaybookRunner._verify, "gpu_check": PlaybookRunner._gpu_check, "bench": PlaybookRunner._bench,
    "watch": PlaybookRunner._watch, "hook": PlaybookRunner._hook,
    "pause": PlaybookRunner._pause, "command": PlaybookRunner._command,
}
