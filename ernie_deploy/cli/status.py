"""`status` (what runs against the plan, drift with fixes) and `logs` (an instance's journal); thin."""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ernie_deploy.cli.remote import BalancerWiring, balancers, connector, fleet_options, ssh_options, targets
from ernie_deploy.errors import DeployError, ExitCode
from ernie_deploy.output.schemas import STATUS_SCHEMA

if TYPE_CHECKING:
    from ernie_deploy.orchestration.transport import Transport

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    p = sub.add_parser("status", help="what runs on each host against the plan, and every drift with its fix",
                       description="Read-only, one round trip per host: per instance its systemd state, uptime, "
                                   "restarts, /health and the vLLM version its process runs; per host that "
                                   "version (and the installed one when they differ), the current release, the "
                                   "last change in the audit log and the deploy lock; and drift: files that "
                                   "differ from the rendered ones, unit files systemd has not reloaded, a process "
                                   "whose command line is not the plan's or that started before its files last "
                                   "changed, staged files that still wait for a restart, a deploy lock left "
                                   "behind or held (`ernie-deploy lock -i INV --break` breaks every stale one), "
                                   "drop-ins, units the plan no longer has, vLLM processes outside the managed "
                                   "units, instances down. Each serving instance's progress: two /metrics "
                                   "readings vllm_progress_window seconds apart (only when it has work), stalled "
                                   "(requests running, no tokens out), stuck (a waiting queue growing, nothing "
                                   "running) or unreadable /metrics is a problem (docs/progress.md). Exit codes: 0 "
                                   "no drift, 2 drift, an instance making no progress (or a plan error), 4 "
                                   "unreachable. With a vllm_balancers group, each instance also shows its "
                                   "server's state on every balancer (UP, DRAIN, DOWN, MAINT; sessions and weight "
                                   "with -v), each balancer gets a row, and a serving instance out of rotation is "
                                   "drift; a balancer that cannot be read counts as unreachable (exit 4).")
    common(p)
    ssh_options(p)
    p.add_argument("--templates", type=Path, metavar="DIR", help="the templates deploy used (as for deploy)")
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {STATUS_SCHEMA})")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="an instance's journal: its current run (or the one before with --previous)",
                       description="The journal lines of one instance's current run (its systemd invocation), "
                                   "without older runs mixed in; -f follows new lines until Ctrl-C.")
    common(p, limit=False)
    ssh_options(p, forks=False)  # one host: -f follows, as with journalctl and tail
    p.add_argument("host", help="inventory host name")
    p.add_argument("--instance", metavar="K", help="index or unit name (default: the host's first instance)")
    p.add_argument("-n", "--lines", type=int, default=50, metavar="N", help="show the last N lines (default 50)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("--previous", action="store_true", help="the run before the current one (after a crash)")
    p.set_defaults(func=cmd_logs)


def cmd_status(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.orchestration.status import StatusReader
    from ernie_deploy.output import console
    from ernie_deploy.output.remote import say_stopped
    from ernie_deploy.output.status import show_status
    inventory, ctx, hosts = targets(args)
    fleet = Fleet(connector(args), fleet_options(args))
    with contextlib.ExitStack() as stack:
        try:
            lbs = stack.enter_context(balancers(args, inventory, ctx))
        except DeployError as exc:
            # Status is how an operator finds what is wrong: a host that does not plan must not hide the rest.
            log.warning("balancers not read: %s", exc)
            lbs = BalancerWiring()
        reader = StatusReader(ctx, fleet, args.templates, balancers=lbs.control, balancer_plans=lbs.plans)
        with console.HostProgress("status") as progress:
            fleet.progress = progress.update
            results = reader.run(hosts)
    code = exit_code(results, fleet.signal)
    say_stopped(fleet.signal)
    show_status(results, reader.reports, code, json=args.json, balancers=reader.balancer_reports,
                verbose=args.verbose > 0)
    return code


def cmd_logs(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.restart import select
    from ernie_deploy.orchestration.transport import target_for
    from ernie_deploy.planning.plan import plan_host
    inventory, ctx, _ = targets(argparse.Namespace(**{**vars(args), "limit": None}))  # -i and --table only
    if args.host not in inventory.hosts:
        raise DeployError(f"no host {args.host!r} in the inventory", where=args.inventory.shown,
                          hint="run `ernie-deploy inventory -i INV --graph` to list the hosts")
    if args.lines < 1:
        raise DeployError(f"--lines must be 1 or more, got {args.lines}")
    host = inventory.hosts[args.host]
    # The inventory-only plan names the units; an instance the host's GPUs would add shows up after a deploy.
    (inst, *_) = select(plan_host(host, ctx), args.instance)
    unit = f"{inst.unit}.service"
    session = connector(args)(target_for(host, tuple(args.known_hosts)))
    try:
        return _show_logs(args, session, unit)
    except KeyboardInterrupt:
        return ExitCode.OK
    finally:
        session.close()


def _show_logs(args: argparse.Namespace, session: Transport, unit: str) -> int:
    from ernie_deploy.output.status import show_log_header, show_log_lines
    from ernie_deploy.remote import logs
    r = session.run(logs.logs_command(unit, args.lines, args.previous))
    if r.code != 0:
        raise DeployError(f"{unit}: {r.stderr.decode(errors='replace').strip() or f'exit {r.code}'}",
                          where=args.host, hint="ernie-deploy status -i INV --limit HOST shows its state")
    invocation, lines, cursor = logs.split(r.text)
    show_log_header(args.host, unit, invocation, previous=args.previous)
    show_log_lines(lines)
    while args.follow:
        time.sleep(1.0)
        r = session.run(logs.logs_command(unit, args.lines, args.previous, cursor))
        _, lines, after = logs.split(r.text)
        cursor = after or cursor
        show_log_lines(lines)
    return ExitCode.OK
