"""`ernie-deploy provision`: thin: options, run the provisioner, hand its results to output/provision.py, exit
code."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ernie_deploy.cli.remote import connector, fleet_options, ssh_options, targets
from ernie_deploy.output.schemas import PROVISION_SCHEMA


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    p = sub.add_parser("provision", help="make bare GPU hosts ready: driver check, service user, pinned vLLM, model",
                       description="Per host, in order: check the NVIDIA driver against what the pinned vLLM "
                                   "needs (a too old one fails the host before anything is installed); create "
                                   "vllm_user; check python3-venv (install it only with "
                                   "vllm_install_os_packages); install vLLM vllm_version into its own venv "
                                   "(/opt/vllm/VERSION) from the host's index, vllm_pip_index_url or a "
                                   "wheelhouse (vllm_pip_find_links) copied over; remove venvs no unit or "
                                   "kept release runs; copy the model from vllm_model_source (a directory "
                                   "here: only changed files, resumable, switched in whole; or "
                                   "hf://ORG/NAME@REVISION, downloaded on the host). Idempotent: a second run "
                                   "reads one probe per host and changes nothing. It never installs drivers "
                                   "or CUDA and never restarts an instance (`deploy` does). See "
                                   "docs/provisioning.md. Exit codes: 0 ok, 2 a host failed, 4 unreachable, "
                                   "6 locked, 130 interrupted (run it again to resume).")
    common(p)
    ssh_options(p)
    p.add_argument("-C", "--check", action="store_true", help="change nothing (no lock taken); say what would change")
    p.add_argument("--verify-files", action="store_true",
                   help="re-hash the model files on the host instead of trusting the recorded manifest "
                        "(sizes and mtimes); replaces any that differ")
    p.add_argument("--bwlimit", metavar="RATE",
                   help="at most RATE per copy stream, e.g. 50M (bytes/s; K, M, G suffixes), to spare a busy "
                        "uplink")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    p.add_argument("--any-errors-fatal", action="store_true", help="stop touching other hosts after a failure")
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {PROVISION_SCHEMA})")
    p.set_defaults(func=cmd_provision)


def cmd_provision(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.details import ProvisionReport
    from ernie_deploy.orchestration.fleet import Fleet
    from ernie_deploy.orchestration.provision import Provisioner, ProvisionOptions
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.output import console
    from ernie_deploy.output.provision import show_provision
    from ernie_deploy.output.remote import say_stopped
    from ernie_deploy.planning.provisioning import parse_rate
    rate = parse_rate(args.bwlimit)
    _, ctx, hosts = targets(args)
    command = "ernie-deploy provision" + (" --check" if args.check else "")
    options = ProvisionOptions(base_dir=args.inventory.base_dir, check=args.check,
                               verify_files=args.verify_files, rate=rate, lock_wait=args.lock_wait, command=command)
    fleet = Fleet(connector(args), replace(fleet_options(args), any_errors_fatal=args.any_errors_fatal))
    provisioner = Provisioner(ctx, options, fleet)
    with console.HostProgress("provision" + (" (check mode)" if args.check else "")) as progress:
        fleet.progress = progress.update
        runs = provisioner.run(hosts)
    results = [r.result for r in runs]
    code = exit_code(results, fleet.signal)
    say_stopped(fleet.signal)
    reports = {r.host.name: r.result.detail_of(ProvisionReport) for r in runs}
    show_provision(results, reports, code, check=args.check, json=args.json, verbose=args.verbose)
    return code
