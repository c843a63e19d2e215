"""Read-only and lock commands on many hosts through the fleet runner: facts, lock --show / --break."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.transport import RemoteHost
from ernie_deploy.planning.plan import PlanContext, plan_host
from ernie_deploy.remote import lock, releases
from ernie_deploy.remote.facts import HostFacts, gather_command, parse_facts


def gather_facts(fleet: Fleet, ctx: PlanContext,
                 hosts: Sequence[RemoteHost]) -> list[tuple[HostResult, HostFacts | None]]:
    def one(run: HostRun[HostFacts]) -> None:
        pre = plan_host(run.host, ctx)
        session = fleet.connect(run)
        with fleet.step(run, "facts"):
            run.state = parse_facts(session.run(gather_command(pre.model_path or "/nonexistent",
                                                                       pre.bin or "vllm")).text)

    return [(r.result, r.state) for r in fleet.run(hosts, [one])]


def lock_state(fleet: Fleet, hosts: Sequence[RemoteHost], *, break_: bool,
               force: bool = False) -> list[tuple[HostResult, str]]:
    """Each host's lock holder (as described), breaking the lock when asked: a holder that may still run
    (alive on this controller, or on another controller, where its pid cannot be checked) only with force."""
    def one(run: HostRun[str]) -> None:
        session = fleet.connect(run)
        with fleet.step(run, "show lock"):
            text = session.run(lock.SHOW).text.strip()
            info = lock.parse_info(text) if text else None
            run.state = ("lock " + info.describe()) if info else ("no lock" if not text else "lock (unreadable)")
        if not break_ or not text:
            return
        if info is not None and info.liveness() != "dead" and not force:
            why = "still runs" if info.liveness() == "alive" else "may still run (another controller)"
            raise DeployError(f"not breaking the lock: its holder {why}: {info.describe()}", where=run.host.name,
                              hint="wait for that deploy to finish, or add --force if you know it is gone")
        with fleet.step(run, "break lock") as step:
            session.run(lock.break_command(info.token if info else None))
            step.changed = True
        run.state = f"broke {run.state}"
        run.result.status = Status.CHANGED

    return [(r.result, r.state or "") for r in fleet.run(hosts, [one])]


@dataclass(frozen=True)
class Kept:
    releases: list[releases.Release]  # oldest first
    current: str | None  # the id of the one whose files are installed


def list_releases(fleet: Fleet, ctx: PlanContext, hosts: Sequence[RemoteHost]
                  ) -> list[tuple[HostResult, list[releases.Release], str | None]]:
    """Each host's kept releases (oldest first) and the id of the current one (its files are what is installed)."""
    def one(run: HostRun[Kept]) -> None:
        pre = plan_host(run.host, ctx)
        session = fleet.connect(run)
        with fleet.step(run, "releases"):
            facts = parse_facts(session.run(gather_command(pre.model_path or "/nonexistent", pre.bin or "vllm")).text)
            kept = releases.parse_list(session.run(releases.list_command()).text)
            run.result.evidence += kept.notes()
        now = releases.current(kept, facts.files)
        run.state = Kept(kept, now.id if now else None)

    return [(r.result, r.state.releases, r.state.current) if r.state else (r.result, [], None)
            for r in fleet.run(hosts, [one])]
