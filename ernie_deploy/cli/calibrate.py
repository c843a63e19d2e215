"""`calibrate`: measure TP × max_model_len × max_num_seqs candidates on one canary per GPU class and write the
best as a measured table row; thin."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ernie_deploy.cli.remote import balancers, connector, fleet_options, ssh_options, targets
from ernie_deploy.output.schemas import CALIBRATE_SCHEMA

TABLE_OUT = "calibration.yml"
MAX_CANDIDATES = 6
TIME_BOUND = 3600.0


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    p = sub.add_parser("calibrate", help="measure candidate TP, max_model_len and max_num_seqs on one canary per "
                                         "GPU class and write the best that meets the SLOs as a table row",
                       description="Per GPU class (gpu_model × gpu_count) of the selected hosts, on its first host: "
                                   "the candidates the planner accepts (TP values the model allows on the GPUs × "
                                   "max_model_len values from the workload's need × max_num_seqs values), each "
                                   "deployed to that host alone as `deploy` would, benched with `vllm bench serve` "
                                   "(the host's vllm_bench_* workload) and judged with its vllm_slo_* limits; the "
                                   "best that meets every SLO (highest output throughput, then lowest p99 TTFT) "
                                   "becomes a measured row of --table-out. The release that ran before is restored "
                                   "afterwards, also after a failure or a signal, and checked. docs/calibrate.md. "
                                   "Exit codes: 0 a row for every class, host restored; 2 no candidate met the SLOs "
                                   "(nothing written for that class) or a restore failed; 4 unreachable; 5 bad "
                                   "input; 130/143 interrupted (restored, nothing written).")
    common(p)
    ssh_options(p)
    p.add_argument("--table-out", type=Path, metavar="FILE",
                   help=f"the table file the measured rows go to, merged with it when it exists (default: "
                        f"{TABLE_OUT} next to the inventory); use it with `plan --table FILE`")
    p.add_argument("--max-candidates", type=_bounded(1, 50), default=MAX_CANDIDATES, metavar="N",
                   help=f"candidates tried per canary at most (default {MAX_CANDIDATES}); the others are listed")
    p.add_argument("--time-bound", type=_bounded(1, 7 * 86400), default=TIME_BOUND, metavar="S",
                   help=f"no candidate starts after S seconds of calibration (default {TIME_BOUND:g})")
    p.add_argument("-C", "--check", action="store_true",
                   help="touch nothing: show the canaries and their candidates (tried, skipped with the planner's "
                        "reason, left out by --max-candidates)")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    p.add_argument("--startup-budget", dest="health_timeout", type=float, default=0.0, metavar="S",
                   help="seconds a candidate may take to become ready (default: the host's vllm_startup_budget)")
    p.add_argument("--no-balancer", action="store_true",
                   help="do not take the canary's instances out of the vllm_balancers around each restart")
    p.add_argument("--save", type=Path, metavar="DIR",
                   help="where each bench's raw result goes, as for `bench --save`")
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {CALIBRATE_SCHEMA})")
    p.set_defaults(func=cmd_calibrate)


def _bounded(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low} to {high}")
        return value
    return parse


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.bench import default_save_dir
    from ernie_deploy.orchestration.calibrate import Calibrator, prepare, write_table
    from ernie_deploy.orchestration.cycle import CycleOptions
    from ernie_deploy.orchestration.deploy import Options
    from ernie_deploy.orchestration.restart import RestartOptions
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.orchestration.rollout import RolloutOptions
    from ernie_deploy.output import console
    from ernie_deploy.output.calibrate import show_calibrate
    from ernie_deploy.output.remote import say_stopped
    inventory, ctx, hosts = targets(args)
    canaries = prepare(hosts, ctx, args.max_candidates)
    table_out: Path = args.table_out or args.inventory.base_dir / TABLE_OUT
    if args.check:
        show_calibrate([], canaries, [], 0, json=args.json, table_out=None, check=True)
        return 0
    save_dir = args.save or default_save_dir()
    known = tuple(args.known_hosts)
    with balancers(args, inventory, ctx) as lb:
        def cycle(command: str) -> CycleOptions:
            return CycleOptions(command=command, balancers=lb.control, balancer_plans=lb.plans)

        deploy = Options(lock_wait=args.lock_wait, health_timeout=args.health_timeout, known_hosts=known,
                         command="ernie-deploy calibrate", cycle=cycle("deploy"),
                         rollout=RolloutOptions(command="calibrate", balancer_hosts=lb.names))
        restore = RestartOptions(mode="rollback", lock_wait=args.lock_wait, known_hosts=known,
                                 command="ernie-deploy calibrate (restore)",
                                 cycle=cycle("rollback"), rollout=RolloutOptions(command="calibrate",
                                                                                balancer_hosts=lb.names))
        calibrator = Calibrator(ctx, connector(args), deploy=deploy, restore=restore,
                                fleet_options=fleet_options(args), time_bound=float(args.time_bound),
                                save_dir=save_dir)
        with console.HostProgress("calibrate") as progress:
            calibrator.progress = progress.update
            results = calibrator.run(canaries)
    rows = [c.row for c in calibrator.calibrations if c.row is not None]
    if rows:
        write_table(table_out, Path(ctx.table.path), rows, ctx)
    code = exit_code(results, calibrator.stopped_by)
    say_stopped(calibrator.stopped_by)
    show_calibrate(results, canaries, calibrator.calibrations, code, json=args.json,
                   table_out=table_out if rows else None, check=False)
    return code
