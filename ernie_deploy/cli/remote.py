"""Commands that talk to hosts: deploy, restart, rollback, releases, verify, facts, lock. Thin: parse options,
run, hand the results to output/remote.py, exit code.

Hosts of the inventory group `vllm_balancers` are never vLLM hosts here (`targets`); deploy, restart and
rollback drive them (`balancers`), planned from every vLLM host of the inventory whatever --limit selects."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ernie_deploy.checks.expectations import Expectations
    from ernie_deploy.checks.result import CheckResult
    from ernie_deploy.inventory.inventory import Host, Inventory
    from ernie_deploy.orchestration.balancers import Balancers
    from ernie_deploy.orchestration.fleet import FleetOptions
    from ernie_deploy.orchestration.results import HostResult
    from ernie_deploy.orchestration.rollout import Report
    from ernie_deploy.orchestration.transport import Connector, Transport
    from ernie_deploy.planning.balancer import BalancerPlan
    from ernie_deploy.planning.drivers import DriverVerdict
    from ernie_deploy.planning.plan import PlanContext
    from ernie_deploy.remote.facts import HostFacts
    from ernie_deploy.remote.ssh import Target
from ernie_deploy.cli import rollout
from ernie_deploy.errors import ExitCode
from ernie_deploy.output.schemas import FACTS_SCHEMA, RELEASES_SCHEMA, RESULTS_SCHEMA, VERIFY_SCHEMA
from ernie_deploy.remote.command import HOST_TIMEOUT
from ernie_deploy.remote.hostkeys import HostKeyPolicy

log = logging.getLogger(__name__)


def ssh_options(p: argparse.ArgumentParser, forks: bool = True) -> None:
    p.add_argument("--host-key-policy", choices=[x.value for x in HostKeyPolicy], default="strict",
                   help="strict (default): refuse unknown and changed host keys; accept-new: record unknown keys "
                        "(logged), still refuse changed ones")
    p.add_argument("--known-hosts", action="append", default=[], metavar="FILE",
                   help="extra known_hosts file (besides ~/.ssh/known_hosts and the inventory's ernie_known_hosts)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S", help="SSH connect timeout")
    p.add_argument("--host-timeout", type=_positive_seconds, default=HOST_TIMEOUT, metavar="S",
                   help="a host that answers nothing for S seconds while a command runs (asked every S/4 seconds, "
                        "as OpenSSH's ServerAliveInterval does) is UNREACHABLE (exit 4), the other hosts go on; "
                        f"a command may run longer than S as long as the host answers (default {HOST_TIMEOUT:.0f})")
    if forks:
        p.add_argument("-f", "--forks", type=int, default=5, metavar="N", help="hosts worked on in parallel")


def targets(args: argparse.Namespace) -> tuple[Any, PlanContext, list[Host]]:
    """The inventory, the planning context and the vLLM hosts --limit selects (never a balancer host). A --limit
    that selects balancer hosts only is bad input: the command has nothing to work on."""
    from ernie_deploy.errors import InventoryError
    from ernie_deploy.planning.balancer import GROUP, split_hosts
    inventory, ctx, hosts = selected(args)
    vllm, balancer_hosts = split_hosts(hosts)
    if balancer_hosts and not vllm:
        raise InventoryError(f"--limit {args.limit} selects only balancer hosts ({', '.join(h.name for h in hosts)}"
                             f", group {GROUP}): this command works on vLLM hosts", where=args.inventory.shown,
                             hint="limit it to vLLM hosts; `ernie-deploy deploy --limit "
                                  f"{balancer_hosts[0].name}` applies a balancer's configuration")
    return inventory, ctx, vllm


def selected(args: argparse.Namespace) -> tuple[Any, PlanContext, list[Host]]:
    """The inventory, the planning context and every host --limit selects, balancers included."""
    from ernie_deploy.cli.inventories import load
    from ernie_deploy.inventory.connection import check_connections
    from ernie_deploy.planning.balancer import split_hosts
    from ernie_deploy.planning.plan import PlanContext
    inventory = load(args)
    ctx = PlanContext.load(getattr(args, "table", None), base_dir=args.inventory.base_dir)
    hosts = list(inventory.select(args.limit))
    vllm, balancer_hosts = split_hosts(hosts)
    # Every ansible_connection is judged before any host is contacted: a bad one touches nothing.
    check_connections(vllm, "vLLM hosts")
    check_connections(balancer_hosts, "balancer hosts")
    return inventory, ctx, hosts


@dataclass
class BalancerWiring:
    """The inventory's balancers for one command: their names, and what drives them."""

    names: tuple[str, ...] = ()  # every balancer host of the inventory
    plans: tuple[BalancerPlan, ...] = ()  # their plans (empty with --no-balancer: not even planned)
    control: Balancers | None = None  # drives them around each restart (None: none, or --no-balancer)
    setup: Balancers | None = None  # those --limit selects, whose configuration deploy applies first


@contextlib.contextmanager
def balancers(args: argparse.Namespace, inventory: Inventory, ctx: PlanContext, *,
              apply: Sequence[str] = ()) -> Iterator[BalancerWiring]:
    """The inventory's balancers, planned from ALL its vLLM hosts (a balancer fronts every instance, whatever
    --limit selects), connected lazily; `apply`: the balancer hosts whose configuration deploy applies. Closed
    on the way out. With --no-balancer nothing is planned or driven (a balancer that is down, or cannot be
    planned, does not stop the command)."""
    from ernie_deploy.planning.balancer import split_hosts
    _, hosts = split_hosts(inventory.hosts.values())
    names = tuple(h.name for h in hosts)
    if not hosts or getattr(args, "no_balancer", False):
        yield BalancerWiring(names)
        return
    from ernie_deploy.inventory.connection import check_connections, check_fronted
    from ernie_deploy.orchestration.balancers import Balancers
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.planning.balancer import fleet_plans, plan_balancers
    check_connections(hosts, "balancer hosts")
    plans = plan_balancers(hosts, fleet_plans(inventory.hosts.values(), ctx),
                           base_dir=args.inventory.base_dir)
    by_name = {h.name: h for h in hosts}
    for plan in plans:
        for _, server in plan.servers():
            check_fronted(by_name[plan.host], plan.address, inventory.hosts[server.host], server.name, server.address)
    fleet = Fleet(connector(args), fleet_options(args))
    control = Balancers(fleet, plans, by_name)
    chosen = [p for p in plans if p.host in apply]
    setup = None if not chosen else control if len(chosen) == len(plans) else Balancers(fleet, chosen, by_name)
    try:
        yield BalancerWiring(names, tuple(plans), control, setup)
    finally:
        control.close()
        if setup is not None and setup is not control:
            setup.close()


@contextlib.contextmanager
def connect_ahead(args: argparse.Namespace, hosts: Sequence[Host]) -> Iterator[Connector]:
    """The command's connector (`connector`), already connecting to the first --forks of `hosts` while the
    command loads the rest of itself (orchestration/ahead.py); what nobody claimed is closed on the way out.
    Called once the command's own input is judged: bad input connects to nothing. A host whose connection
    variables are bad is not connected ahead: the fleet reports it on that host alone, as before."""
    from ernie_deploy.errors import DeployError
    from ernie_deploy.orchestration.ahead import ConnectAhead
    from ernie_deploy.orchestration.transport import target_for
    targets = []
    for host in hosts[:max(1, args.forks)]:  # only those ConnectAhead takes: no target built for the rest
        with contextlib.suppress(DeployError):
            targets.append(target_for(host, args.known_hosts))
    ahead = ConnectAhead(connector(args), targets, args.forks)
    try:
        yield ahead
    finally:
        ahead.close()


def fleet_options(args: argparse.Namespace) -> FleetOptions:
    from ernie_deploy.orchestration.fleet import FleetOptions
    return FleetOptions(forks=args.forks, known_hosts=tuple(args.known_hosts))


def connector(args: argparse.Namespace) -> Connector:
    """Opens a host's transport: SSH, or this machine itself for ansible_connection local (remote/local.py),
    where the host-key policy, known_hosts and --host-timeout do not apply."""
    from ernie_deploy.inventory.connection import ConnectionType
    from ernie_deploy.remote import local
    from ernie_deploy.remote.ssh import connect
    policy = HostKeyPolicy(args.host_key_policy)
    if policy is HostKeyPolicy.ACCEPT_NEW:
        from ernie_deploy.output.remote import say_accept_new  # only then: it loads the results' renderers
        log.warning("host key policy accept-new: unknown host keys will be recorded")
        say_accept_new(getattr(args, "check", False))
    # Check mode changes nothing, the controller's known_hosts included.
    over_ssh = partial(connect, policy=policy, timeout=args.connect_timeout, record=not getattr(args, "check", False),
                       host_timeout=args.host_timeout)

    def open_transport(target: Target) -> Transport:
        return local.connect(target) if target.connection is ConnectionType.LOCAL else over_ssh(target)

    return open_transport


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (e.g. 60)")
    return value


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    p = sub.add_parser("deploy", help="converge hosts to the plan over SSH (units, env files, restarts)",
                       description="Plan each host from its real facts, upload only changed files atomically, "
                                   "daemon-reload once, and restart only the instances whose unit or env "
                                   "changed, one at a time per host (drain, stop, wait for its GPUs, start, "
                                   "verify). A failed instance gets the release that ran before it back "
                                   "(--no-rollback keeps it failed). A change to serving instances rolls one "
                                   "host at a time (the inventory's vllm_serial, or --serial; --serial all for "
                                   "every host at once); hosts with nothing running go first, together. Exit "
                                   "codes: 0 ok, 2 a host failed, 4 a host unreachable, 6 a host's deploy lock is "
                                   "held, 5 bad input.")
    common(p)
    ssh_options(p)
    p.add_argument("-C", "--check", action="store_true", help="change nothing; report what would change")
    p.add_argument("-D", "--diff", action="store_true", help="show unified diffs (secrets as [REDACTED])")
    p.add_argument("--prune", action="store_true", help="remove units of instances no longer in the plan")
    p.add_argument("--any-errors-fatal", action="store_true", help="stop touching other hosts after a failure")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    p.add_argument("--startup-budget", "--health-timeout", dest="health_timeout", type=float, default=0.0,
                   metavar="S", help="seconds a (re)started instance may take to become ready (default: each "
                                     "host's vllm_startup_budget, 600 unless set)")
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {RESULTS_SCHEMA})")
    p.add_argument("--playbook", type=Path, metavar="FILE",
                   help="a playbook whose verify tasks' checks (expect/forbid log patterns, a streamed smoke test) run "
                        "after each restart, e.g. playbooks/verify.yml")
    p.add_argument("--templates", type=Path, metavar="DIR",
                   help="your own vllm.service.j2 / vllm.env.j2 instead of the bundled ones (as for render)")
    rollout.add_options(p)
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("restart", help="restart running instances batch by batch without losing capacity",
                       description="Restart instances on purpose (after a driver or model-file update, or to clear "
                                   "a wedged one), like Ansible's serial: per batch of hosts, each instance is "
                                   "taken out of the load balancer (--pre-drain), drained, stopped, its GPUs "
                                   "waited for, started, verified and put back (--post-ready). Refuses to start "
                                   "when an instance in scope is down already, unless --force. Exit codes: 0 ok, "
                                   "2 a host failed or the rollout stopped, 4 unreachable, 6 locked, 130 "
                                   "interrupted (continue with --resume).")
    common(p)
    ssh_options(p)
    _day2_options(p)
    rollout.add_options(p, rollback=False, instance=True)
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("rollback", help="restore an earlier release kept on the hosts, restart and verify",
                       description="Put back the release before the current one (or --to ID, see `releases`), "
                                   "then restart its instances batch by batch like `restart` and verify them "
                                   "against the restored unit files. An instance that fails goes back to what "
                                   "ran before the rollback, and the release gets marked failed on the host. "
                                   "A release marked failed is refused (naming when and why it failed) unless "
                                   "--force. --check shows the batches and each file's diff (env files "
                                   "redacted).")
    common(p)
    ssh_options(p)
    _day2_options(p)
    p.add_argument("--to", metavar="RELEASE", help="the release id to restore (default: the one before the current)")
    rollout.add_options(p, instance=True)
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("releases", help="list the releases kept on each host (to choose one for rollback)",
                       description="Read-only: each host's kept releases, oldest first, with time, who made them, "
                                   "what changed, which one is installed now (current), and which failed to "
                                   "start and were rolled back (when and why; rollback --to asks for --force).")
    common(p)
    ssh_options(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {RELEASES_SCHEMA})")
    p.set_defaults(func=cmd_releases)

    p = sub.add_parser("verify", help="check running services: readiness, smoke test, log keywords, GPU balance",
                       description="Without restarting anything, check every instance: systemd state, its start-up "
                                   "log (the tensor parallel size vLLM really uses, context length, KV capacity, "
                                   "no fatal errors), /health, /v1/models, one small completion, and GPU balance. "
                                   "With --bench, each instance whose checks pass is then load-tested with vLLM's "
                                   "`vllm bench serve` and judged against its SLOs. "
                                   "Exit codes: 0 all checks pass, 2 a check failed (an SLO missed, with --bench), "
                                   "4 a host unreachable.")
    common(p)
    ssh_options(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {VERIFY_SCHEMA})")
    p.add_argument("--junit", type=Path, metavar="FILE", help="also write JUnit XML for CI pipelines")
    p.add_argument("--playbook", type=Path, metavar="FILE",
                   help="a playbook whose verify tasks add checks: expect/forbid log patterns, a streamed smoke "
                        "test (playbooks/verify.yml)")
    p.add_argument("--bench", action="store_true",
                   help="after an instance's checks pass, bench it (`vllm bench serve` on its host, the inventory's "
                        "vllm_bench_* workload, one instance at a time; docs/bench.md): the bench and each SLO "
                        "(vllm_slo_*) become checks, and the JSON carries each bench's numbers. Without SLOs set "
                        "it still benches and reports the numbers, judging nothing. Raw results are saved under "
                        "$XDG_STATE_HOME/ernie-deploy/bench (else ~/.local/state/ernie-deploy/bench)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("facts", help="what each host really has: GPUs, NVLink, systemd, units, model, vLLM",
                       description="Gather facts in one SSH round trip per host, read-only: GPUs, NVLink, "
                                   "systemd, the managed units, the model's config.json, the vLLM installed at "
                                   "the default path and, per running instance, the vLLM its process runs (they "
                                   "differ after a rollback to a release of another version).")
    common(p)
    ssh_options(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {FACTS_SCHEMA})")
    p.set_defaults(func=cmd_facts)

    p = sub.add_parser("lock", help="show or break the deploy lock on hosts",
                       description="Every deploy holds a lock directory on each host while it works. A crashed "
                                   "deploy can leave it behind: --show names its holder, --break removes it.")
    common(p)
    ssh_options(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--show", action="store_true")
    mode.add_argument("--break", dest="break_", action="store_true",
                      help="remove the lock; refused while its holder may still run, unless --force")
    p.add_argument("--force", action="store_true",
                   help="with --break: break even a lock whose holder may still run (another controller's)")
    p.set_defaults(func=cmd_lock)


def _day2_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-C", "--check", action="store_true",
                   help="change nothing: show the batches and what each instance would go through (no hook runs)")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    p.add_argument("--startup-budget", dest="health_timeout", type=float, default=0.0, metavar="S",
                   help="seconds a started instance may take to become ready (default: each host's "
                        "vllm_startup_budget)")
    p.add_argument("--playbook", type=Path, metavar="FILE",
                   help="a playbook whose verify tasks' checks run after each start (playbooks/verify.yml)")
    p.add_argument("--templates", type=Path, metavar="DIR",
                   help="the templates deploy used (as for deploy), to compare the hosts' files with the plan")
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {RESULTS_SCHEMA})")


def cmd_deploy(args: argparse.Namespace) -> int:
    from ernie_deploy.planning.balancer import render_balancer, split_hosts
    inventory, ctx, chosen = selected(args)
    hosts, chosen_balancers = split_hosts(chosen)
    command = "ernie-deploy deploy" + (" --check" if args.check else "")
    exp = playbook_checks(args.playbook)
    rollout.validate(args)
    with balancers(args, inventory, ctx, apply=[h.name for h in chosen_balancers]) as lb, \
            connect_ahead(args, hosts) as connect:
        from ernie_deploy.orchestration.deploy import Options, Runner  # loads while the hosts connect
        from ernie_deploy.output import console
        gate = rollout.slo_gate(args)
        options = Options(check=args.check, diff=args.diff, prune=args.prune, forks=args.forks,
                          any_errors_fatal=args.any_errors_fatal, lock_wait=args.lock_wait,
                          health_timeout=args.health_timeout, known_hosts=tuple(args.known_hosts),
                          command=command, templates=args.templates,
                          cycle=rollout.cycle_options(args, "deploy", lb.control, lb.plans, gate),
                          rollout=rollout.rollout_options(args, "deploy", preflight=args.serial is not None,
                                                          balancers=lb.names, gate=gate),
                          balancer_setup=lb.setup, render_balancer=render_balancer)
        runner = Runner(ctx, connect, options, expectations=exp)
        with console.HostProgress("deploy" + (" (check mode)" if args.check else "")) as progress:
            runner.fleet.progress = progress.update
            results = runner.run(hosts)
    return _finish(args, "deploy", results, runner.stopped_by, runner.report)


def _finish(args: argparse.Namespace, name: str, results: list[HostResult], stopped_by: int | None,
            report: Report) -> int:
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.output.remote import say_stopped, show_outcome
    code = exit_code(results, stopped_by)
    say_stopped(stopped_by)
    rollout.write_timeline(args, report, f"ernie-deploy {name}")
    show_outcome(name, results, code, report, json=args.json, check=args.check, verbose=args.verbose)
    return code


def _restart(args: argparse.Namespace, mode: str) -> int:
    inventory, ctx, hosts = targets(args)
    command = f"ernie-deploy {mode}" + (" --check" if args.check else "")
    exp = playbook_checks(args.playbook)
    rollout.validate(args)
    with balancers(args, inventory, ctx) as lb, connect_ahead(args, hosts) as connect:
        from ernie_deploy.orchestration.restart import Restarter, RestartOptions  # loads while the hosts connect
        from ernie_deploy.output import console
        gate = rollout.slo_gate(args)
        cycle = dataclasses.replace(rollout.cycle_options(args, mode, lb.control, lb.plans, gate),
                                    health_timeout=args.health_timeout)
        options = RestartOptions(mode=mode, instance=args.instance, to=getattr(args, "to", None), check=args.check,
                                 forks=args.forks, lock_wait=args.lock_wait, known_hosts=tuple(args.known_hosts),
                                 command=command, templates=args.templates, cycle=cycle,
                                 rollout=rollout.rollout_options(args, mode, preflight=True, balancers=lb.names,
                                                                 gate=gate))
        restarter = Restarter(ctx, connect, options, expectations=exp)
        with console.HostProgress(mode + (" (check mode)" if args.check else "")) as progress:
            restarter.fleet.progress = progress.update
            results = restarter.run(hosts)
    return _finish(args, mode, results, restarter.stopped_by, restarter.report)


def cmd_restart(args: argparse.Namespace) -> int:
    return _restart(args, "restart")


def cmd_rollback(args: argparse.Namespace) -> int:
    return _restart(args, "rollback")


def cmd_releases(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.hosts import list_releases
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.output.remote import show_releases
    _, ctx, hosts = targets(args)
    listed = list_releases(Fleet(connector(args), fleet_options(args)), ctx, hosts)
    show_releases(listed, json=args.json)
    return exit_code([r for r, _, _ in listed])


def cmd_verify(args: argparse.Namespace) -> int:
    from ernie_deploy.checks.junit import to_junit
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.orchestration.verify import Verifier
    from ernie_deploy.output import console
    from ernie_deploy.output.remote import say_stopped, show_verify
    _, ctx, hosts = targets(args)
    exp = playbook_checks(args.playbook)
    verifier = Verifier(ctx, connector(args), fleet_options(args), expectations=exp,
                        bench={} if args.bench else None)
    with console.HostProgress("verify") as progress:
        verifier.fleet.progress = progress.update
        results = verifier.run(hosts)
    code = exit_code(results, verifier.stopped_by)
    say_stopped(verifier.stopped_by)
    if args.junit:
        args.junit.write_text(to_junit({r.host: r.checks or [_unreached(r)] for r in results}))
    show_verify(results, code, json=args.json, verbose=args.verbose,
                benches=verifier.reports if args.bench else None)
    return code


def playbook_checks(path: Path | None) -> Expectations:
    """The `verify` task arguments of a playbook's plays (expect/forbid patterns, a streamed smoke test)."""
    from ernie_deploy.checks.expectations import Expectations
    from ernie_deploy.playbook.schema import load_playbook
    return load_playbook(path).expectations() if path is not None else Expectations()


def _unreached(r: HostResult) -> CheckResult:
    from ernie_deploy.checks.result import CheckResult
    return CheckResult("host", "fail", f"{r.status.value}: {r.message}", fix=r.hint)


def _driver(host: Host, facts: HostFacts) -> tuple[str, DriverVerdict] | None:
    """The host's driver against what its vLLM needs (the pinned version, else the installed one, else the
    default); None without a driver or below the table's lowest release."""
    from ernie_deploy.planning.drivers import judge, need
    from ernie_deploy.planning.versions import version_facts
    version = str(host.vars.get("vllm_version") or facts.vllm_version or version_facts().default)
    wanted = need(version)
    if wanted is None or not facts.gpus:
        return None
    return version, judge(facts.gpus[0].driver, wanted)


def cmd_facts(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.hosts import gather_facts
    from ernie_deploy.output.remote import show_facts
    _, ctx, hosts = targets(args)
    fleet = Fleet(connector(args), fleet_options(args))
    results = gather_facts(fleet, ctx, hosts)
    drivers = {r.host: _driver(h, f) if f else None for h, (r, f) in zip(hosts, results, strict=True)}
    show_facts(results, drivers, json=args.json)
    return ExitCode.UNREACHABLE if any(r.finished for r, _ in results) else ExitCode.OK


def cmd_lock(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.hosts import lock_state
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.output.remote import show_locks
    _, _, hosts = selected(args)  # a balancer host has a deploy lock too (deploy applies its configuration)
    results = lock_state(Fleet(connector(args), fleet_options(args)), hosts, break_=args.break_, force=args.force)
    show_locks(results)
    return exit_code([r for r, _ in results])
