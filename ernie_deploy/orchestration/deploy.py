"""Deploy orchestration: per host, plan → facts → converge → wait for /health; hosts in parallel.

Talks to hosts only through a `Connector` (the SSH factory in production, a fake in unit tests).
A host's failure never stops the others unless `any_errors_fatal` is set; every lock taken is
released in `finally`, also on Ctrl-C.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Protocol

from ernie_deploy.checks.playbook import Expectations
from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import readiness
from ernie_deploy.orchestration.instancecheck import instance_checks
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.plan import HostLike, PlanContext, plan_host
from ernie_deploy.planning.plantypes import Discovered, HostPlan, InstancePlan
from ernie_deploy.planning.render import environment_for_templates, render_host, templates_dir
from ernie_deploy.remote import converge, lock, probe
from ernie_deploy.remote.facts import HostFacts, gather_script, parse_facts
from ernie_deploy.remote.ssh import Failure, RemoteError, RunResult, Target


class Session(Protocol):
    commands: int
    history: list[str]

    def run(self, script: str, *, stdin: bytes = b"", timeout: float = 120.0, check: bool = True,
            label: str | None = None) -> RunResult: ...

    def close(self) -> None: ...


Connector = Callable[[Target], Session]
Progress = Callable[[str, str], None]  # (host, what it is doing now)


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


def discovered(facts: HostFacts) -> Discovered:
    names = {g.name for g in facts.gpus}
    return Discovered(
        gpu_name=facts.gpus[0].name if len(names) == 1 else (", ".join(sorted(names)) or None),
        gpu_count=len(facts.gpus), gpu_memory_mib=min((g.memory_mib for g in facts.gpus), default=None),
        nvlink=facts.nvlink, gpu_error=facts.gpu_error if facts.gpus or facts.gpu_error else "no GPUs listed",
        model_config=facts.model_config, model_error=facts.model_error,
        vllm_version=facts.vllm_version, vllm_error=facts.vllm_error,
    )


def target_for(host: HostLike, known_hosts: Sequence[str]) -> Target:
    h = host  # inventory Host: address, port, user
    return Target.from_host(h.name, h.address, h.port, h.user, h.vars, known_hosts)  # type: ignore[attr-defined]


class Runner:
    """One deploy (or check) run over many hosts."""

    def __init__(self, ctx: PlanContext, connector: Connector, options: Options,
                 progress: Progress | None = None, expectations: Expectations | None = None) -> None:
        self.ctx = ctx
        self.connect = connector
        self.options = options
        self.progress = progress or (lambda host, what: None)
        self.abort = threading.Event()
        self.templates = environment_for_templates(templates_dir())
        self.lock = lock.LockInfo.mine(options.command)
        self.expectations = expectations or Expectations()

    def run(self, hosts: Sequence[HostLike]) -> list[HostResult]:
        results: dict[str, HostResult] = {}
        with ThreadPoolExecutor(max_workers=max(1, self.options.forks)) as pool:
            futures = {pool.submit(self._guarded, h): h.name for h in hosts}
            try:
                for future in as_completed(futures):
                    result = future.result()
                    results[result.host] = result
            except KeyboardInterrupt:
                self.abort.set()
                raise
        return [results[h.name] for h in hosts]

    def _guarded(self, host: HostLike) -> HostResult:
        result = HostResult(host.name)
        started = time.monotonic()
        try:
            if self.abort.is_set():
                result.status, result.message = Status.SKIPPED, "skipped: another host failed (--any-errors-fatal)"
            else:
                self._host(host, result)
        except LockHeld as exc:
            result.status, result.message, result.hint = Status.LOCKED, exc.message, exc.hint
        except RemoteError as exc:
            result.status = Status.UNREACHABLE if exc.kind is Failure.UNREACHABLE else Status.FAILED
            result.message, result.hint = exc.message, exc.hint
        except DeployError as exc:
            result.status, result.message, result.hint = Status.FAILED, exc.message, exc.hint
        finally:
            result.seconds = time.monotonic() - started
            # Set by the worker itself, so a free worker cannot pick up the next host first.
            if self.options.any_errors_fatal and result.status in (Status.FAILED, Status.UNREACHABLE, Status.LOCKED):
                self.abort.set()
        return result

    def _host(self, host: HostLike, result: HostResult) -> None:
        opts = self.options
        pre = plan_host(host, self.ctx)  # inventory-only plan: paths for the facts script, input errors early
        if any(f.code == "input" for f in pre.errors):
            result.status, result.findings = Status.FAILED, pre.errors
            result.message = "the plan has errors; nothing was touched"
            return
        self.progress(host.name, "connecting")
        session = self.connect(target_for(host, opts.known_hosts))
        locked = False
        try:
            self.progress(host.name, "gathering facts")
            gather = gather_script(pre.model_path, pre.bin)
            if opts.check:  # check mode takes no lock: creating the lock directory would be a change
                text = session.run(gather, label="gather facts").text
            else:
                text = self._lock_and_gather(session, host.name, gather)
                locked = True
            facts = parse_facts(text)
            plan = plan_host(host, self.ctx, discovered(facts))
            result.findings = [f for f in plan.findings if f.severity is not Severity.INFO]
            if not plan.ok:
                result.status, result.message = Status.FAILED, "the plan has errors; nothing was touched"
                return
            self._converge(session, plan, facts, result)
        finally:
            try:
                if locked:
                    session.run(lock.release_script(self.lock.token), label="release lock", check=False)
            except RemoteError as exc:
                result.evidence.append(f"could not release the deploy lock: {exc.message}")
            finally:
                result.commands, result.command_log = session.commands, list(session.history)
                session.close()

    def _lock_and_gather(self, session: Session, host: str, gather: str) -> str:
        """Take the lock and gather facts in one round trip; with --lock-wait retry the same atomic step."""
        deadline = time.monotonic() + self.options.lock_wait
        delay = 1.0
        while True:
            r = session.run(lock.acquire_script(self.lock) + gather, label="lock + gather facts", check=False)
            if r.code == 0:
                return r.text
            if r.code != lock.HELD_EXIT:
                raise RemoteError(Failure.COMMAND, f"taking the deploy lock failed ({r.code}): "
                                  f"{r.stderr.decode(errors='replace').strip()}", where=host)
            holder = lock.parse_info(r.text.split("\n", 1)[1] if "\n" in r.text else "")
            if time.monotonic() >= deadline or self.abort.is_set():
                raise LockHeld(holder.describe() if holder else "held (no details file)", host)
            self.progress(host, f"waiting for the deploy lock ({holder.describe() if holder else 'held'})")
            time.sleep(min(delay, max(0.1, deadline - time.monotonic())))
            delay = min(delay * 2, 10.0)

    def _converge(self, session: Session, plan: HostPlan, facts: HostFacts, result: HostResult) -> None:
        opts = self.options
        files = render_host(plan, self.templates)
        changes = converge.compute_changes(plan, files, facts, opts.prune)
        result.changed_files = [c.path for c in changes.files]
        result.restarted, result.started = list(changes.restart), list(changes.start)
        result.enabled, result.pruned, result.reasons = list(changes.enable), list(changes.prune), changes.reasons
        if opts.diff and changes.files:
            existing = [c.path for c in changes.files if c.old_sha256]
            old = converge.parse_read(session.run(converge.read_script(existing), label="read files for --diff").text
                                      ) if existing else {}
            by_path = {f.path: f for f in files}
            result.diffs = [converge.unified_diff(c.path, old.get(c.path) if c.old_sha256 else None,
                                                  by_path[c.path].content, c.secret) for c in changes.files]
        if changes.empty:
            result.status, result.message = Status.OK, "nothing to change: units and env files match, all running"
            return
        result.status = Status.CHANGED
        if opts.check:
            result.message = "would change (check mode: nothing was touched)"
            return
        if self.abort.is_set():
            result.status, result.message = Status.SKIPPED, "skipped before changing anything: run aborted"
            return
        self.progress(plan.name, f"applying {len(changes.files)} file(s)")
        audit = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "user": self.lock.user,
                 "controller": self.lock.controller, "command": opts.command, "host": plan.name,
                 "files": [{"path": c.path, "old_sha256": c.old_sha256, "new_sha256": c.new_sha256}
                           for c in changes.files],
                 "restart": list(changes.restart), "start": list(changes.start), "prune": list(changes.prune)}
        applied = session.run(converge.apply_script(files, changes), stdin=converge.payload(files, changes, audit),
                              label="apply changes", timeout=300).text
        since = next((f"@{line.split()[-1]}" for line in applied.splitlines()
                      if line.startswith("@@ernie-deploy:restart-at ")), None)
        started = [i for i in plan.instances if f"{i.unit}.service" in changes.restart + changes.start]
        if started and since is not None and not self._verify_started(session, plan, started, since, result):
            return
        result.message = "changed; every (re)started instance verified" if started else "changed"

    def _verify_started(self, session: Session, plan: HostPlan, started: list[InstancePlan], since: str,
                        result: HostResult) -> bool:
        """Readiness watch, then every instance check, for each (re)started instance. False on failure."""
        budget = self.options.health_timeout or float(plan.settings["startup_budget"].value)
        for inst in started:
            self.progress(plan.name, f"waiting for {inst.unit} to become ready")
            ready = readiness.watch(session, plan, inst, since=since, budget=budget, exp=self.expectations,
                                    abort=self.abort)
            if ready.status != "ready":
                result.status, result.message = Status.FAILED, ready.summary
                result.hint = " · ".join(x for x in (ready.cause, ready.fix) if x) or None
                result.evidence = ready.evidence
                return False
        self.progress(plan.name, "checking the started instances")
        units = [f"{i.unit}.service" for i in started]
        units_state, other = probe.parse(session.run(probe.host_script(units), label="probe instances").text)
        for inst in started:
            result.checks += instance_checks(plan, inst, units_state.get(f"{inst.unit}.service", probe.UnitState()),
                                             other.get("gpus", ""), other.get("apps", ""), other.get("ps", ""),
                                             self.expectations)
        failed = [c for c in result.checks if c.status == "fail"]
        if failed:
            result.status = Status.FAILED
            result.message = f"{len(failed)} check(s) failed after the restart: " + "; ".join(c.summary for c in failed)
            return False
        return True


class LockHeld(DeployError):
    def __init__(self, holder: str, host: str) -> None:
        super().__init__(f"deploy lock {holder}", where=host,
                         hint="wait with --lock-wait SECONDS, or if that deploy is dead: "
                              "ernie-deploy lock -i INV --limit HOST --break")
