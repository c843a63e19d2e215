"""The fleet's load balancers at run time: what a rolling restart asks of them, over the fleet's SSH door.

A restart takes an instance out of every balancer that fronts it (HAProxy `state drain`) before the instance
stops, and puts it back (`state ready`) once it passed the readiness gate; it reads the balancers' own view of
the instance's server (state, current sessions) to wait on it. A deploy applies each balancer's rendered
configuration first (`Balancers.apply`), and status reads every balancer's view (`Balancers.all_stats`).
docs/balancer.md.

`Balancers` opens one SSH session per balancer host, lazily, through the fleet's connector (known_hosts and
--host-timeout apply as to any host), and serialises the commands sent to one balancer with a lock of its own,
so host threads share it. A balancer that cannot be reached is a problem sentence, never an exception, and is
remembered: later calls report it at once instead of waiting for another connection timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import audit
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.orchestration.transport import RemoteHost, Transport
from ernie_deploy.planning.balancer import BalancerPlan
from ernie_deploy.remote import lock
from ernie_deploy.remote.balancer import (
    SHOW_STAT,
    AdminAnswers,
    Applied,
    ServerStat,
    admin_command,
    admin_problem,
    apply_command,
    deploy_hint,
    parse_admin,
    parse_apply,
    parse_stat,
    set_command,
    set_problem,
)
from ernie_deploy.remote.ssh import Failure, RemoteError

__all__ = ["AdminState", "Applied", "BalancerControl", "Balancers", "ServerStat"]

log = logging.getLogger(__name__)
AdminState = Literal["drain", "ready"]
T = TypeVar("T")


class BalancerControl(Protocol):
    """What the rollout asks of the fleet's balancers. Host threads share one; each call is safe to make from
    several at once. Every problem is a sentence naming the balancer host (and the fix, where there is one)."""

    def fronting(self, host: str, index: int) -> list[str]:
        """The balancer hosts whose configuration has instance `index` of vLLM host `host`."""
        ...

    def set_state(self, host: str, index: int, state: AdminState) -> list[str]:
        """Set the instance's server to `state` on every balancer fronting it; the problems ([] when all did)."""
        ...

    def stats(self, host: str, index: int) -> tuple[dict[str, ServerStat], list[str]]:
        """Each fronting balancer's view of the instance's server (balancer host → stat), and the problems of
        those that could not be read."""
        ...

    def unreachable(self) -> list[str]:
        """Problems of balancers that cannot be driven now (no SSH, no admin socket, HAProxy not running):
        a rollout refuses to start on them."""
        ...


@dataclass
class _Link:
    """One balancer host: its plan, its run (session, steps, command log) and the lock its commands take turns
    on. `problem`: why it cannot be driven, once its connection failed."""

    plan: BalancerPlan
    run: HostRun[None]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    problem: str | None = None


class Balancers:
    """The fleet's balancers, driven over SSH: a `BalancerControl` for rollouts, `apply` for deploy and
    `all_stats` for status. `close()` ends the sessions (always call it)."""

    def __init__(self, fleet: Fleet, plans: Sequence[BalancerPlan], hosts: Mapping[str, RemoteHost]) -> None:
        unknown = [p.host for p in plans if p.host not in hosts]
        if unknown:
            raise DeployError(f"balancer hosts without an inventory entry: {', '.join(unknown)}",
                              hint="pass every balancer plan's host (inventory group vllm_balancers)")
        self.fleet = fleet
        self._links = {p.host: _Link(p, HostRun(hosts[p.host], HostResult(p.host))) for p in plans}

    @property
    def plans(self) -> list[BalancerPlan]:
        return [link.plan for link in self._links.values()]

    def results(self) -> list[HostResult]:
        """Each balancer host's result so far: its steps, commands and command log."""
        out = []
        for link in self._links.values():
            result = link.run.result
            if link.run.session is not None:
                result.commands, result.command_log = link.run.session.commands, list(link.run.session.history)
            out.append(result)
        return out

    # --- BalancerControl ---

    def fronting(self, host: str, index: int) -> list[str]:
        return [name for name, link in self._links.items() if link.plan.server_for(host, index) is not None]

    def set_state(self, host: str, index: int, state: AdminState) -> list[str]:
        def one(name: str) -> str | None:
            link = self._links[name]
            found = link.plan.server_for(host, index)
            assert found is not None  # fronting() chose it
            backend, server = found
            command = set_command(backend.name, server.name, state)
            answers, problem = self._admin(link, [command])
            if answers is None:
                return problem
            refused = set_problem(answers.answers[0])
            if refused is None:
                return None
            return (f"{name}: HAProxy refused `{command}`: {refused}; "
                    f"{deploy_hint(name) if refused.startswith('No such') else 'check HAProxy on ' + name}")

        return [p for p in self._each(self.fronting(host, index), one) if p is not None]

    def stats(self, host: str, index: int) -> tuple[dict[str, ServerStat], list[str]]:
        def one(name: str) -> tuple[ServerStat | None, str | None]:
            link = self._links[name]
            found = link.plan.server_for(host, index)
            assert found is not None
            backend, server = found
            live, problem = self._stat(link)
            if live is None:
                return None, problem
            stat = live.get((backend.name, server.name))
            if stat is None:
                return None, (f"{name}: HAProxy's running configuration has no server {backend.name}/{server.name}"
                              f": {deploy_hint(name)}")
            return stat, None

        names = self.fronting(host, index)
        seen, problems = {}, []
        for name, (stat, problem) in zip(names, self._each(names, one), strict=True):
            if stat is not None:
                seen[name] = stat
            if problem is not None:
                problems.append(problem)
        return seen, problems

    def unreachable(self) -> list[str]:
        """Balancers whose admin socket cannot be read now (SSH, python3, socket, HAProxy down)."""
        return [p for p in self._each(list(self._links), lambda name: self._stat(self._links[name])[1])
                if p is not None]

    # --- status and deploy ---

    def all_stats(self) -> dict[str, dict[str, ServerStat] | str]:
        """Each balancer's view of the servers of its planned backends (server name → stat: a planned server its
        running configuration lacks is absent, one the plan does not have is there), or the problem sentence when
        it could not be read. Backends the plan does not have (a user's template may add some) are left out."""

        def one(name: str) -> dict[str, ServerStat] | str:
            link = self._links[name]
            live, problem = self._stat(link)
            if live is None:
                return problem or f"{name}: no answer from HAProxy"
            backends = {b.name for b in link.plan.backends}
            return {server: stat for (backend, server), stat in live.items() if backend in backends}

        names = list(self._links)
        return dict(zip(names, self._each(names, one), strict=True))

    def apply(self, render: Callable[[BalancerPlan], str], *, who: lock.LockInfo | None = None,
              check: bool = False) -> dict[str, Applied]:
        """Render and apply each balancer's configuration (balancer host → what happened). Under the balancer
        host's deploy lock (`who`'s, so the audit record names the deploy; by default a lock of its own); in
        check mode nothing changes and no lock is taken. A render error, an unreachable host and a lock held
        by another run are that balancer's error; nothing raises."""
        me = who or lock.LockInfo.mine("deploy (balancer)")
        names = list(self._links)
        return dict(zip(names, self._each(names, lambda name: self._apply(self._links[name], render, me, check)),
                        strict=True))

    def close(self) -> None:
        for link in self._links.values():
            with link.lock:
                if link.run.session is not None:
                    self.results()
                    try:
                        link.run.session.close()
                    except Exception:  # closing must reach every balancer
                        log.debug("%s: closing the session failed", link.plan.host, exc_info=True)
                    link.run.session = None
                    link.problem = link.problem or f"{link.plan.host}: the balancer's session was closed"

    # --- helpers ---

    def _each(self, names: Sequence[str], fn: Callable[[str], T]) -> list[T]:
        """fn on each balancer at once (a dead one costs one connection timeout, not one each), in order."""
        if len(names) <= 1:
            return [fn(n) for n in names]
        with ThreadPoolExecutor(max_workers=min(8, len(names)), thread_name_prefix="ernie-balancer") as pool:
            return list(pool.map(fn, names))

    def _session(self, link: _Link) -> Transport | None:
        """The balancer's session, opened on first use; None (and `link.problem`) when it cannot be reached.
        Called with link.lock held."""
        if link.problem is not None:
            return None
        try:
            return self.fleet.connect(link.run)
        except DeployError as exc:
            link.problem = _sentence(link.plan.host, exc)
            return None

    def _admin(self, link: _Link, commands: Sequence[str]) -> tuple[AdminAnswers | None, str | None]:
        """HAProxy's answers to `commands`, or the problem."""
        plan = link.plan
        with link.lock:
            session = self._session(link)
            if session is None:
                return None, link.problem
            try:
                result = session.run(admin_command(plan.admin_socket, commands))
            except DeployError as exc:
                problem = _sentence(plan.host, exc)
                if isinstance(exc, RemoteError) and exc.kind is Failure.UNREACHABLE:
                    link.problem = problem
                return None, problem
        answers = parse_admin(result.text)
        if answers.error is not None:
            return None, admin_problem(plan.host, plan.admin_socket, answers.error, answers.detail)
        if len(answers.answers) < len(commands):
            tail = " ".join(result.stderr.decode(errors="replace").strip().splitlines()[-3:]) or f"exit {result.code}"
            return None, f"{plan.host}: HAProxy's runtime API did not answer on {plan.admin_socket}: {tail}"
        return answers, None

    def _stat(self, link: _Link) -> tuple[dict[tuple[str, str], ServerStat] | None, str | None]:
        answers, problem = self._admin(link, [SHOW_STAT])
        if answers is None:
            return None, problem
        live = parse_stat(answers.answers[0])
        if not live and not answers.answers[0].startswith("# "):
            return None, f"{link.plan.host}: HAProxy answered `show stat` with: {' '.join(answers.answers[0].split())}"
        return live, None

    def _apply(self, link: _Link, render: Callable[[BalancerPlan], str], who: lock.LockInfo, check: bool) -> Applied:
        plan = link.plan
        try:
            config = render(plan)
            command = apply_command(plan, config, audit.record(who, plan.host, "balancer apply",
                                                               config=plan.config_path), check=check)
        except DeployError as exc:  # a template or a value that cannot be placed: named where it is
            where = f"{exc.where}: " if exc.where and exc.where != plan.host else ""
            return Applied(plan.host, check=check, error=f"{where}{exc.message}", hint=exc.hint)
        if not check:  # two deploys must not swap the file under each other
            command = dataclasses.replace(command, intent=lock.Acquire(who, command.intent))
        applied: Applied | None = None
        with link.lock:
            session = self._session(link)
            if session is None:
                return Applied(plan.host, check=check, error=link.problem)
            try:
                result = session.run(command)
                if result.code == lock.HELD_EXIT:
                    holder = lock.parse_info(result.text.partition("lock-held")[2].strip())
                    return Applied(plan.host, check=check,
                                   error=f"deploy lock {holder.describe() if holder else 'held (no details file)'}",
                                   hint=f"wait for that run, or if it is dead: ernie-deploy lock -i INV --limit "
                                        f"{plan.host} --break")
                applied = parse_apply(plan.host, plan, result.text, result.stderr.decode(errors="replace"),
                                      check=check)
                if not check:
                    # What was applied stays said; a lock left behind is this balancer's error all the same,
                    # since it blocks the next deploy.
                    lock.check_release(session.run(lock.release_command(who.token)), plan.host)
            except DeployError as exc:
                if isinstance(exc, RemoteError) and exc.kind is Failure.UNREACHABLE:
                    link.problem = _sentence(plan.host, exc)
                applied = dataclasses.replace(applied or Applied(plan.host, check=check),
                                              error=_sentence(plan.host, exc), hint=exc.hint)
        return _redacted(applied, plan)


def _sentence(host: str, exc: DeployError) -> str:
    """A host's error as a problem sentence naming the balancer host, with its fix."""
    text = f"{host}: {exc.message}"
    return f"{text} (fix: {exc.hint})" if exc.hint else text


def _redacted(applied: Applied, plan: BalancerPlan) -> Applied:
    """HAProxy quotes configuration lines in its errors; the API key of a health check must not reach output."""
    if applied.error is None:
        return applied
    text = applied.error
    for backend in plan.backends:
        if backend.api_key is not None and backend.api_key.reveal():
            text = text.replace(backend.api_key.reveal(), "[REDACTED]")
    return dataclasses.replace(applied, error=text)
