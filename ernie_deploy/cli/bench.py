"""`bench`: vLLM's own load test against each instance, with the SLO verdicts; thin."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ernie_deploy.cli.remote import connector, fleet_options, ssh_options, targets
from ernie_deploy.output.schemas import BENCH_SCHEMA

# Option → the bench setting it overrides for this run (planning/settings.py BENCH_TYPES).
OVERRIDES = {"input_len": "bench_input_len", "output_len": "bench_output_len", "num_prompts": "bench_num_prompts",
             "request_rate": "bench_request_rate", "max_concurrency": "bench_max_concurrency",
             "bench_timeout": "bench_timeout", "seed": "bench_seed"}


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    p = sub.add_parser("bench", help="load-test each instance with vLLM's own `vllm bench serve` and judge its SLOs",
                       description="Per instance, on its host (from the instance's venv, through SSH; the API key on "
                                   "stdin): /health first (an instance that is down is named, not benched), then "
                                   "`vllm bench serve` with the random dataset, bounded in requests and time; TTFT, "
                                   "TPOT, ITL and end-to-end latency percentiles, throughput and goodput, and each "
                                   "SLO's verdict. The workload and SLOs are inventory variables (vllm_bench_*, "
                                   "vllm_slo_*: docs/bench.md); the options below override the workload for this "
                                   "run. A host's instances run one after another, hosts in parallel. A bench past "
                                   "its time bound is stopped and its partial numbers shown. Exit codes: 0 every "
                                   "bench finished and met its SLOs, 2 an SLO failed, a bench failed or timed out, "
                                   "or an instance is down, 4 unreachable, 5 bad input.")
    common(p)
    ssh_options(p)
    p.add_argument("--instance", metavar="K", help="one instance per host: its index or unit name")
    p.add_argument("--num-prompts", type=_positive(int), metavar="N", help="requests to send (vllm_bench_num_prompts)")
    p.add_argument("--input-len", type=_positive(int), metavar="TOKENS", help="prompt length (vllm_bench_input_len)")
    p.add_argument("--output-len", type=_positive(int), metavar="TOKENS",
                   help="tokens generated per request (vllm_bench_output_len)")
    p.add_argument("--max-concurrency", type=_positive(int), metavar="N",
                   help="requests in flight at most (vllm_bench_max_concurrency)")
    p.add_argument("--request-rate", type=_positive(float), metavar="RPS",
                   help="requests per second (vllm_bench_request_rate; default: all at once)")
    p.add_argument("--timeout", dest="bench_timeout", type=_positive(float), metavar="S",
                   help="seconds one bench may run before it is stopped (vllm_bench_timeout)")
    p.add_argument("--seed", type=_positive(int, zero=True), metavar="N", help="the random dataset's seed")
    p.add_argument("--save", type=Path, metavar="DIR",
                   help="where each raw result file goes, as DIR/HOST/UNIT-TIME.json (default: "
                        "$XDG_STATE_HOME/ernie-deploy/bench, else ~/.local/state/ernie-deploy/bench)")
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {BENCH_SCHEMA})")
    p.set_defaults(func=cmd_bench)


def _positive(kind: type[int] | type[float], zero: bool = False) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'} "
                                             f"{'of 0 or more' if zero else 'above 0'}")
        return value
    return parse


def cmd_bench(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.bench import BenchRunner, default_save_dir
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.output import console
    from ernie_deploy.output.bench import show_bench
    from ernie_deploy.output.remote import say_stopped
    _, ctx, hosts = targets(args)
    overrides = {setting: getattr(args, option) for option, setting in OVERRIDES.items()
                 if getattr(args, option) is not None}
    fleet = Fleet(connector(args), fleet_options(args))
    save_dir = args.save or default_save_dir()
    runner = BenchRunner(ctx, fleet, overrides=overrides, instance=args.instance, save_dir=save_dir)
    with console.HostProgress("bench") as progress:
        fleet.progress = progress.update
        results = runner.run(hosts)
    code = exit_code(results, fleet.signal)
    say_stopped(fleet.signal)
    show_bench(results, runner.reports, code, json=args.json, save_dir=save_dir)
    return code
