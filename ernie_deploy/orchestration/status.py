"""`status`: what really runs on each host against the plan, read in one round trip (and one more for the
progress of its serving instances), changing nothing.

Per instance: systemd's state, uptime, restarts, /health, the vLLM its process runs, and whether it makes
progress (two /metrics readings a window apart: stalled, stuck or unreadable is a problem, docs/progress.md;
only an instance with work costs the wait). Per host: that vLLM and
the installed one, the current release (the kept release whose files are the installed ones), the last change
in the audit log, the deploy lock. And drift, each with its fix: managed files that differ from the rendered
ones; unit files systemd has not reloaded (NeedDaemonReload); a main process whose command line is not the
plan's ExecStart (a unit edited by hand and restarted), or that started before its unit or env file last
changed (an edit not in effect); units staged and not restarted (judged by what runs); a deploy lock left
behind or held; drop-ins on managed units; managed units the plan no longer has; and `vllm serve` processes
outside every managed unit (started by hand).

With the fleet's balancers (inventory group `vllm_balancers`), each instance also shows its server's state as
every balancer sees it (HAProxy's `show stat`: UP, DRAIN, MAINT, DOWN and the current sessions), and each
balancer gets its own row: HAProxy read or why not, how many of its planned servers are UP. More drift, each
with its fix: an instance that serves but is out of a balancer's rotation (left drained by an interrupted
rollout, or failing the balancer's health check), an instance a balancer's live configuration does not know,
servers a balancer has that the plan does not. A balancer that cannot be read counts as an unreachable host.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from ernie_deploy.checks.progress import Progress
from ernie_deploy.orchestration.balancers import ServerStat
from ernie_deploy.orchestration.cycle import unit_of
from ernie_deploy.orchestration.details import Drift, StatusReport
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.progress import host_thresholds, read_serving
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.snapshot import Snapshot, SnapshotOptions, take
from ernie_deploy.orchestration.transport import RemoteHost
from ernie_deploy.planning.balancer import GROUP, BalancerBackend, BalancerPlan, BalancerServer
from ernie_deploy.planning.hostpaths import LOCK_DIR
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.render import exec_words, unescape_word, unit_environment
from ernie_deploy.remote import converge, lock, releases
from ernie_deploy.remote.facts import HostFacts
from ernie_deploy.remote.status import HostStatus, parse, status_script
from ernie_deploy.remote.systemd import up_seconds


def expected_args(snap: Snapshot, unit: str) -> tuple[str, ...] | None:
    """The arguments after `serve` the plan's ExecStart passes, as the process would see them."""
    for inst in snap.plan.instances:
        if unit_of(inst) == unit:
            words = [unescape_word(w) for w in exec_words(snap.plan, inst)]
            return tuple(words[words.index("serve") + 1:])
    return None


def waits_for_restart(unit: str, facts: HostFacts) -> bool:
    """Whether a unit on the pending list really waits for a restart, judged by what runs: the list alone can
    be stale (a controller killed after the restart, before it cleared the entry). A process that started after
    the unit's files last changed runs them. Change times, not modification times: a restore copies with
    `cp -p`, which keeps the old mtime, and only a new inode's ctime says when it arrived. Unknown (the unit
    not running, no clock or times read): the list is believed."""
    changed = converge.changed_after_start(unit, facts, facts.ctimes)
    return changed is None or bool(changed)


def drifts(host: str, snap: Snapshot, seen: HostStatus) -> list[Drift]:
    fix = f"ernie-deploy deploy -i INV --limit {host}"
    facts, changes = snap.facts, snap.changes
    out = []
    for c in changes.files:
        what = "is missing" if c.old_sha256 is None else "differs from the plan (edited by hand, or not deployed)"
        out.append(Drift("file", c.path, f"{c.path} {what}", fix))
    planned = [unit_of(i) for i in snap.plan.instances]
    for unit in planned:
        state = facts.units.get(unit)
        if state is None:
            continue
        if state.need_daemon_reload:
            out.append(Drift("daemon-reload", unit, f"{unit}: its unit file changed on disk and systemd still runs "
                                                    "the definition it loaded before (NeedDaemonReload=yes)", fix))
        proc = seen.procs.get(seen.main_pids.get(unit, 0))
        args = proc.serve_args if proc is not None else None
        wanted = expected_args(snap, unit)
        if args is not None and wanted is not None and args != wanted:
            out.append(Drift("cmdline", unit, f"{unit} runs `vllm serve {shlex.join(args)}`, the plan says "
                                              f"`vllm serve {shlex.join(wanted)}`", fix))
        newer = converge.newer_than_process(unit, facts)
        if newer and unit not in facts.pending:
            out.append(Drift("not-applied", unit, f"{unit}: {', '.join(newer)} changed after its process started, "
                                                  "so the change is not in effect", fix))
        if unit in facts.pending and waits_for_restart(unit, facts):
            out.append(Drift("pending", unit, f"{unit}: staged files wait for a restart", fix))
        problem = converge.serving_problem(unit, facts, snap.plan.tuning.stable_seconds)
        if problem is not None:
            story = converge.death_story(unit, facts, fix)
            out.append(Drift("down", unit, f"{unit}: {problem}", story.fix if story and story.fix else fix))
    if facts.lock_info:
        out.append(lock_drift(host, facts.lock_info))
    for path in changes.dropins:
        out.append(Drift("drop-in", path, f"{path} overrides a managed unit (systemctl edit?)",
                         f"fold the setting into the inventory, then {fix} --prune"))
    for unit in changes.leftover:
        out.append(Drift("leftover", unit, f"{unit} is installed but not in the plan", f"{fix} --prune"))
    managed = {f"{PurePosixPath(p).name}" for p in facts.files if p.endswith(".service")}
    # A server's engine and workers can share its command line and cgroup: one drift per server, the oldest.
    foreign: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for proc in sorted(seen.procs.values(), key=lambda p: p.pid):
        if proc.serve_args is not None and proc.unit not in managed:
            foreign.setdefault((proc.cgroup, proc.argv), []).append(proc.pid)
    for (cgroup, argv), pids in foreign.items():
        owner = seen.procs[pids[0]].unit
        where = f"in {owner}" if owner else f"outside systemd ({cgroup or 'no cgroup'})"
        more = f" (and {len(pids) - 1} process(es) of it)" if len(pids) > 1 else ""
        out.append(Drift("process", str(pids[0]), f"vLLM process {pids[0]}{more} runs {where}, not under a managed "
                                                  f"unit: {shlex.join(argv)}",
                         f"stop it (kill {pids[0]}) if it is not yours to keep, then {fix}"))
    return out


# The drift kind of an instance that serves but makes no progress (docs/progress.md).
PROGRESS = "progress"

# One command breaks every lock whose holder is gone, on all hosts at once (lock_state refuses the others).
BREAK_ALL = "ernie-deploy lock -i INV --break"


def lock_drift(host: str, text: str) -> Drift:
    """A deploy lock left on the host: stale (its holder's process is gone), held by a run that may still go on,
    or half-taken (no details). Each blocks every deploy, restart and --resume on the host until broken."""
    holder = lock.parse_info(text)
    if holder is None:
        return Drift("lock", LOCK_DIR, f"the deploy lock {LOCK_DIR} is held without readable details (a run "
                                       "died while taking it); every deploy, restart and rollback is refused",
                     f"{BREAK_ALL} (breaks every lock whose holder is gone, on all hosts)")
    liveness = holder.liveness()
    if liveness == "dead":
        return Drift("lock", LOCK_DIR, f"stale deploy lock: {holder.describe()}; every deploy, restart and "
                                       "--resume is refused until it is broken",
                     f"{BREAK_ALL} (breaks every stale lock, on all hosts)")
    if liveness == "alive":
        return Drift("lock", LOCK_DIR, f"a run holds the deploy lock (pid {holder.pid} still runs on this "
                                       f"controller): {holder.describe()}",
                     f"wait for it to finish; if it hangs, stop it (kill {holder.pid}), then {BREAK_ALL}")
    return Drift("lock", LOCK_DIR, f"the deploy lock is held from another controller (its process cannot be "
                                   f"checked from here): {holder.describe()}",
                 f"if that run is gone: {BREAK_ALL} --force --limit {host}")


def report_of(host: str, snap: Snapshot, seen: HostStatus) -> StatusReport:
    facts = snap.facts
    # What serves is the vLLM the running processes use; the default path's version is beside it when it
    # differs (after a rollback to a release of another vllm_version, or an upgrade not yet restarted).
    running = facts.running_versions()
    report = StatusReport(vllm=", ".join(running) if running else facts.vllm_version,
                          vllm_installed=facts.vllm_version)
    stable = snap.plan.tuning.stable_seconds
    for inst in snap.plan.instances:
        unit = unit_of(inst)
        state = facts.units.get(unit)
        up = up_seconds(state, facts.now_us) if state is not None else None
        problem, story = converge.serving_problem(unit, facts, stable), converge.death_story(unit, facts)
        report.instances.append({
            "unit": unit, "index": inst.index, "gpus": list(inst.gpus), "port": inst.port,
            "state": f"{state.active_state}/{state.sub_state}" if state else "not installed",
            "pid": state.main_pid if state else 0, "uptime_s": round(up, 1) if up is not None else None,
            "restarts": state.n_restarts if state else 0, "health": facts.health.get(unit),
            "vllm": (facts.running[unit].version or "?") if unit in facts.running else None,
            "serving": problem is None, "problem": problem, "death": story.to_json() if story else None,
            "progress": None,  # read once the snapshot says which instances serve: StatusReader._host
            "balancers": {}})  # filled once the balancers are read: StatusReader.run
    now = releases.current(seen.releases, facts.files)
    report.release = now.id if now else None
    if seen.audit:
        last = seen.audit[-1]
        report.last_change = {k: last.get(k) for k in ("time", "user", "controller", "command", "action")}
    holder = lock.parse_info(facts.lock_info) if facts.lock_info else None
    report.lock = holder.describe() if holder else ("held (no details)" if facts.lock_info else None)
    report.drift = drifts(host, snap, seen)
    return report


# -- the balancers' view ------------------------------------------------------------------------------------------

DEPLOY_BALANCERS = f"ernie-deploy deploy -i INV --limit {GROUP}"


class BalancerView(Protocol):
    """What status reads of the fleet's balancers (orchestration/balancers.py `Balancers` is one)."""

    def all_stats(self) -> Mapping[str, Mapping[str, ServerStat] | str]:
        """Each balancer host's servers as HAProxy's `show stat` lists them (server name → stat), or the problem
        sentence (naming the balancer) when that balancer could not be read."""
        ...


def in_rotation(stat: ServerStat) -> bool:
    """Whether HAProxy sends the server new requests: UP (also "UP 1/2", still up while a check fails), or
    "no check" (a server line without `check`, as a hand-made configuration may have)."""
    return stat.up or stat.status == "no check"


@dataclass
class BalancerReport:
    """One balancer host as status read it: HAProxy's view of its servers against the balancer's plan."""

    plan: BalancerPlan
    problem: str | None = None  # why it could not be read; None when HAProxy answered
    servers: dict[str, ServerStat] = field(default_factory=dict)  # what `show stat` listed, by server name
    drift: list[Drift] = field(default_factory=list)

    @property
    def host(self) -> str:
        return self.plan.host

    @property
    def up(self) -> int:
        """Planned servers HAProxy sends requests to."""
        return sum(1 for _, s in self.plan.servers() if s.name in self.servers and in_rotation(self.servers[s.name]))

    def to_json(self) -> dict[str, Any]:
        planned = {s.name: b.name for b, s in self.plan.servers()}
        names = list(planned) + sorted(set(self.servers) - set(planned))
        return {"error": self.problem, "kind": self.plan.kind, "listen": f"{self.plan.bind}:{self.plan.port}",
                "admin_socket": self.plan.admin_socket, "planned": len(planned),
                "up": None if self.problem else self.up,
                "servers": {n: {"backend": planned.get(n), "planned": n in planned,
                                **server_json(None if self.problem else self.servers.get(n), read=not self.problem)}
                            for n in names},
                "drift": [d.to_json() for d in self.drift]}


def server_json(stat: ServerStat | None, *, read: bool) -> dict[str, Any]:
    """A server as one balancer sees it; `configured` is None when the balancer could not be read."""
    return {"configured": (stat is not None) if read else None, "status": stat.status if stat else None,
            "sessions": stat.scur if stat else None, "weight": stat.weight if stat else None,
            "in_rotation": in_rotation(stat) if stat else None}


def read_balancers(plans: Sequence[BalancerPlan], view: BalancerView, read_hosts: set[str]) -> list[BalancerReport]:
    """Every balancer's answer, and its own drift: servers its live configuration has that the plan does not,
    and planned servers it lacks whose vLLM host this run did not read (those of a read host are named on the
    instance: `instance_view`)."""
    answers = view.all_stats()
    out = []
    for plan in plans:
        answer = answers.get(plan.host, f"{plan.host}: the balancer was not read")
        if isinstance(answer, str):
            out.append(BalancerReport(plan, problem=answer))
            continue
        report = BalancerReport(plan, servers=dict(answer))
        planned = {s.name: s for _, s in plan.servers()}
        extra = sorted(set(report.servers) - set(planned))
        if extra:
            report.drift.append(Drift("balancer-config", plan.host, f"{plan.host}'s live HAProxy configuration has "
                                      f"server(s) the plan does not: {', '.join(extra)}", DEPLOY_BALANCERS))
        missing = [n for n, s in planned.items() if n not in report.servers and s.host not in read_hosts]
        if missing:
            report.drift.append(Drift("balancer-config", plan.host, f"{plan.host}'s live HAProxy configuration "
                                      f"lacks planned server(s): {', '.join(missing)}", DEPLOY_BALANCERS))
        out.append(report)
    return out


def instance_view(host: str, index: int, serving: bool,
                  balancers: Sequence[BalancerReport]) -> tuple[dict[str, dict[str, Any]], list[Drift]]:
    """Instance `index` of vLLM host `host` as each balancer sees it, and the drift of that: serving but out of a
    balancer's rotation, or unknown to its live configuration. An instance that does not serve is expected to be
    out of rotation (its own drift says why it does not serve)."""
    columns: dict[str, dict[str, Any]] = {}
    out = []
    for b in balancers:
        found = b.plan.server_for(host, index)
        backend, server = found if found is not None else (None, None)
        # The plan names every server `<host>-<index>` (planning/balancer.py), also one it does not have.
        name = server.name if server is not None else f"{host}-{index}"
        stat = b.servers.get(name)
        columns[b.host] = {"server": name, **server_json(stat, read=b.problem is None)}
        if b.problem is not None:
            continue  # the balancer's own row names the problem
        if stat is None:
            out.append(Drift("balancer-config", f"{b.host}/{name}", f"{b.host}'s live HAProxy configuration has "
                             f"no server {name}: this instance gets no requests through it", DEPLOY_BALANCERS))
        elif serving and not in_rotation(stat):
            out.append(rotation_drift(b.plan, name, stat, backend, server, (host, index)))
    return columns, out


def rotation_drift(plan: BalancerPlan, name: str, stat: ServerStat, backend: BalancerBackend | None,
                   server: BalancerServer | None, instance: tuple[str, int] = ("HOST", 0)) -> Drift:
    """A serving instance that a balancer sends no requests to, and the fix an operator can run now. Drain and
    maintenance are administrative states (the runtime API set them: a rollout stopped, or a hand-run drain);
    only `state ready` ends them, and a rollout's --resume knows only the instances its state file recorded,
    so the fix is HAProxy's own command on the balancer. DOWN and NOLB come from the health check failing; a
    check that timed out on an instance whose /health answers 200 is a hung engine (`instance`: its host and
    index, for the restart)."""
    subject, where = f"{plan.host}/{name}", f"{plan.host} ({stat.status})"
    if stat.status.startswith(("DRAIN", "MAINT")):
        what = "drained" if stat.status.startswith("DRAIN") else "in maintenance"
        message = (f"{name} serves but is out of rotation on {where}: {what} through HAProxy's runtime API (by "
                   "a rollout that stopped, or by hand), so it gets no requests")
        if backend is None:
            return Drift("balancer", subject, message, DEPLOY_BALANCERS)
        command = f"set server {backend.name}/{name} state ready"
        return Drift("balancer", subject, message,
                     f"on {plan.host} as root: echo {shlex.quote(command)} | socat stdio "
                     f"{shlex.quote(plan.admin_socket)}  # socat: apt-get install socat")
    target = f"{server.address}:{server.port}" if server is not None else "the instance"
    if stat.check_status == "L7TOUT":
        # The check is a completion and the instance's /health answers 200 (it counts as serving): the request
        # reached vLLM, which took it and produced nothing in time. Not the network: the engine.
        return Drift("balancer", subject, f"{name} is not generating: {where} marks it down because its "
                                          f"completion check to {target} timed out (Layer7 timeout) while its "
                                          "/health answers 200: the engine is hung",
                     f"restart it: ernie-deploy restart -i INV --limit {instance[0]} --instance {instance[1]} (or "
                     f"ernie-deploy watch -i INV --limit {instance[0]} --restart-stalled), and read why in its "
                     f"journal: ernie-deploy logs -i INV {instance[0]} --instance {instance[1]}")
    return Drift("balancer", subject, f"{name} serves but {where} fails its health check (a completion request "
                                      f"to {target}), so it gets no requests",
                 f"check that {plan.host} reaches {target} (firewall, the instance's bind address) and that its "
                 f"configuration is current: {DEPLOY_BALANCERS}")


def progress_drift(unit: str, progress: Progress) -> Drift:
    """A serving instance that makes no progress (stalled, stuck) or whose /metrics cannot be read."""
    return Drift(PROGRESS, unit, f"{unit}: {progress.state}: {progress.evidence}", progress.fix or "")


def add_progress(report: StatusReport, found: Mapping[str, Progress]) -> None:
    """Each instance row's progress (None: not read, as it does not serve), and the drift of those unhealthy."""
    for inst in report.instances:
        progress = found.get(inst["unit"].removesuffix(".service"))
        inst["progress"] = progress.to_json() if progress is not None else None
        if progress is not None and not progress.healthy():
            report.drift.append(progress_drift(inst["unit"], progress))


def judge(result: HostResult, report: StatusReport) -> None:
    """Failed on drift or on an instance that makes no progress (exit 2 either way, as verify's progress check)."""
    sick = [d for d in report.drift if d.kind == PROGRESS]
    drift = [d for d in report.drift if d.kind != PROGRESS]
    if drift or sick:
        result.status = Status.FAILED
        result.message = "; ".join([*([f"{len(sick)} instance(s) making no progress"] if sick else []),
                                    *([f"{len(drift)} drift(s) from the plan"] if drift else [])])
        result.hint = f"ernie-deploy deploy -i INV --limit {result.host}" if drift else sick[0].fix
    else:
        serving = sum(1 for i in report.instances if i["serving"])
        result.message = f"no drift; {serving} of {len(report.instances)} instance(s) serving"


def balancer_result(b: BalancerReport) -> HostResult:
    """A balancer's row among the hosts' results: unreadable counts as unreachable (exit 4), drift as failed."""
    result = HostResult(b.host)
    if b.problem is not None:
        result.fail(Status.UNREACHABLE, b.problem)
    elif b.drift:
        result.fail(Status.FAILED, f"{len(b.drift)} drift(s) from the plan", DEPLOY_BALANCERS)
    else:
        result.message = f"HAProxy answers; {b.up} of {len(b.plan.servers())} planned server(s) UP"
    return result


class StatusReader:
    """Reads the selected vLLM hosts through the fleet, then, when given, every balancer through `balancers`
    (the plans of all the inventory's balancers: each fronts every instance)."""

    def __init__(self, ctx: PlanContext, fleet: Fleet, templates: Path | None = None, *,
                 balancers: BalancerView | None = None, balancer_plans: Sequence[BalancerPlan] = ()) -> None:
        self.ctx, self.fleet = ctx, fleet
        self.templates = unit_environment(templates)
        self.balancers, self.balancer_plans = balancers, tuple(balancer_plans)
        self.results: list[HostResult] = []
        self.balancer_reports: dict[str, BalancerReport] = {}

    @property
    def reports(self) -> dict[str, StatusReport]:
        """The report of each host that was read (not those unreachable or with plan errors)."""
        return {r.host: r.detail for r in self.results if isinstance(r.detail, StatusReport)}

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostResult]:
        """The vLLM hosts' results, then one per balancer (none after a signal stopped the run)."""
        self.results = [r.result for r in self.fleet.run(hosts, [self._host])]
        if self.balancers is not None and self.balancer_plans and self.fleet.signal is None:
            self._read_balancers(self.balancers)
        return self.results

    def _host(self, run: HostRun[None]) -> None:
        th = host_thresholds(run)
        if th is None:
            return
        snap = take(self.fleet, run, self.ctx, self.templates, SnapshotOptions(extra=status_script()))
        if snap is None:
            return
        report = report_of(run.host.name, snap, parse(snap.text))
        serving = [i for i, row in zip(snap.plan.instances, report.instances, strict=True) if row["serving"]]
        add_progress(report, read_serving(self.fleet, run, snap.plan, serving, th))
        run.result.detail = report
        judge(run.result, report)

    def _read_balancers(self, view: BalancerView) -> None:
        reports = self.reports
        read = read_balancers(self.balancer_plans, view, set(reports))
        for result in self.results:
            report = reports.get(result.host)
            if report is None:
                continue
            for inst in report.instances:
                inst["balancers"], found = instance_view(result.host, inst["index"], inst["serving"], read)
                report.drift.extend(found)
            judge(result, report)
        self.balancer_reports = {b.host: b for b in read}
        self.results.extend(balancer_result(b) for b in read)
