"""`watch`: the progress check repeated for a bounded time, and with --restart-stalled the watchdog's restarts
(orchestration/watch.py, docs/watch.md); thin."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ernie_deploy.cli.remote import BalancerWiring, balancers, connector, fleet_options, ssh_options, targets
from ernie_deploy.playbook.actions import ACTIONS, WATCH_MAX_SECONDS, WATCH_MIN_EVERY

if TYPE_CHECKING:
    from ernie_deploy.orchestration.watch import WatchOptions

_TASK = ACTIONS["watch"].args  # the playbook's watch task has the same defaults
_ROLL = ACTIONS["rolling"].args  # and a restart the same knobs as `restart`'s


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    from ernie_deploy.output.schemas import WATCH_SCHEMA
    p = sub.add_parser("watch", help="repeat the progress check for a while; optionally restart stalled instances",
                       description="Read every instance's forward progress (two /metrics readings a progress "
                                   "window apart: a stalled engine answers /health but generates no token) in "
                                   "rounds, every --every seconds for --for seconds, printing each round's "
                                   "instances that are stalled, stuck, unreadable or down with the evidence and "
                                   "the fix. With --restart-stalled a stalled or stuck instance is restarted "
                                   "through the cycle of `restart --instance` (drained on the balancers, gated, "
                                   "audited; a failed one is named), one at a time, at most --max-restarts times "
                                   "each, never while it is the last healthy instance serving its model; the "
                                   "next round judges it. Exit codes: 0 every instance healthy in the last round, "
                                   "2 one not (stalled, stuck, unreadable, down) or a restart failed, 4 a host "
                                   "unreachable in the last round, 5 bad input, 130 interrupted (docs/watch.md).")
    common(p)
    ssh_options(p)
    p.add_argument("--for", dest="seconds", type=float, default=_TASK["for"].default, metavar="S",
                   help=f"keep starting rounds for S seconds (default {_TASK['for'].default:g}, at most "
                        f"{WATCH_MAX_SECONDS:g}); a restart's own round may follow")
    p.add_argument("--every", type=float, default=_TASK["every"].default, metavar="S",
                   help=f"start a round every S seconds (default {_TASK['every'].default:g}, at least "
                        f"{WATCH_MIN_EVERY:g})")
    p.add_argument("--once", action="store_true", help="one round (and, after a restart, the round that judges it)")
    p.add_argument("--json", action="store_true", help=f"one document at the end (schema {WATCH_SCHEMA})")
    g = p.add_argument_group("remediation", "restart stalled instances like `restart --instance` (docs/watch.md)")
    g.add_argument("--restart-stalled", action="store_true",
                   help="restart a stalled or stuck instance (one at a time, never the last healthy one serving "
                        "its model)")
    g.add_argument("--max-restarts", type=int, default=1, metavar="N",
                   help="restart an instance at most N times in one watch (default 1)")
    g.add_argument("--pre-drain", metavar="CMD", help="as for restart: before an instance is stopped")
    g.add_argument("--post-ready", metavar="CMD", help="as for restart: after it passed the readiness gate")
    g.add_argument("--hook-timeout", type=float, default=_ROLL["hook_timeout"].default, metavar="S",
                   help="longest a hook may run")
    g.add_argument("--idle-timeout", type=float, default=_ROLL["idle_timeout"].default, metavar="S",
                   help="wait up to S seconds for in-flight requests to finish before the stop (a stalled "
                        "instance's never do: the stop goes on after S)")
    g.add_argument("--gpu-release-timeout", type=float, default=_ROLL["gpu_release_timeout"].default, metavar="S",
                   help="wait up to S seconds after a stop for the instance's GPUs to be free")
    g.add_argument("--startup-budget", dest="health_timeout", type=float, default=0.0, metavar="S",
                   help="seconds a restarted instance may take to become ready (default: vllm_startup_budget)")
    g.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    g.add_argument("--no-balancer", action="store_true",
                   help="as for restart: leave the inventory's balancers alone around a restart")
    g.add_argument("--no-slo-gate", action="store_true", help="as for restart: no SLO bench after a restart")
    g.add_argument("--templates", type=Path, metavar="DIR",
                   help="the templates deploy used, to compare the hosts' files with the plan before a restart")
    p.set_defaults(func=cmd_watch)


def options_of(args: argparse.Namespace, lb: BalancerWiring) -> WatchOptions:
    from ernie_deploy.orchestration.bench import SloGate
    from ernie_deploy.orchestration.cycle import CycleOptions
    from ernie_deploy.orchestration.watch import WatchOptions, restart_options
    cycle = CycleOptions(pre_drain=args.pre_drain, post_ready=args.post_ready, hook_timeout=args.hook_timeout,
                         idle_timeout=args.idle_timeout, gpu_timeout=args.gpu_release_timeout,
                         health_timeout=args.health_timeout, balancers=lb.control, balancer_plans=lb.plans)
    restart = restart_options("ernie-deploy watch --restart-stalled", cycle, forks=args.forks,
                              lock_wait=args.lock_wait, known_hosts=tuple(args.known_hosts), templates=args.templates,
                              balancer_hosts=lb.names, slo_gate=SloGate(enabled=not args.no_slo_gate))
    return WatchOptions(seconds=args.seconds, every=args.every, once=args.once, restart_stalled=args.restart_stalled,
                        max_restarts=args.max_restarts, restart=restart)


def cmd_watch(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.watch import Watcher
    from ernie_deploy.output.remote import say_stopped
    from ernie_deploy.output.watch import ConsoleView, show_end
    options_of(args, BalancerWiring()).check()  # bad bounds: before the balancers are planned or any host read
    inventory, ctx, hosts = targets(args)
    fleet = Fleet(connector(args), fleet_options(args))
    # Only a restart drives the balancers: a watch that restarts nothing leaves them unread.
    wiring = balancers(args, inventory, ctx) if args.restart_stalled else contextlib.nullcontext(BalancerWiring())
    with wiring as lb:
        watcher = Watcher(ctx, fleet, options_of(args, lb),
                          view=ConsoleView(json=args.json, verbose=getattr(args, "verbose", 0) > 0))
        report = watcher.run(hosts)
    say_stopped(report.stopped_by)
    show_end(report, json=args.json)
    return report.code
