"""Commands that talk to hosts: facts, deploy, lock. Thin: parse options, run, print, exit code."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ernie_deploy.checks.junit import to_junit
from ernie_deploy.checks.playbook import Expectations, load_playbook
from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import DeployError
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.deploy import Options, Runner, target_for
from ernie_deploy.orchestration.results import JSON_SCHEMA, exit_code
from ernie_deploy.orchestration.verify import Verifier
from ernie_deploy.output import console
from ernie_deploy.output.recap import show_checks, show_recap, show_results
from ernie_deploy.planning.plan import PlanContext, plan_host
from ernie_deploy.remote import lock
from ernie_deploy.remote.facts import gather_script, parse_facts
from ernie_deploy.remote.ssh import HostKeyPolicy, RemoteError, connect

log = logging.getLogger(__name__)


def _ssh_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-key-policy", choices=[x.value for x in HostKeyPolicy], default="strict",
                   help="strict (default): refuse unknown and changed host keys; accept-new: record unknown keys "
                        "(logged), still refuse changed ones")
    p.add_argument("--known-hosts", action="append", default=[], metavar="FILE",
                   help="extra known_hosts file (besides ~/.ssh/known_hosts and the inventory's ernie_known_hosts)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S", help="SSH connect timeout")
    p.add_argument("-f", "--forks", type=int, default=5, metavar="N", help="hosts worked on in parallel")


def _targets(args: argparse.Namespace) -> tuple[Any, PlanContext, list[Any]]:
    inventory = load_inventory(args.inventory)
    ctx = PlanContext.load(getattr(args, "table", None), base_dir=args.inventory.resolve().parent)
    return inventory, ctx, list(inventory.select(args.limit))


def _connector(args: argparse.Namespace) -> Any:
    policy = HostKeyPolicy(args.host_key_policy)
    if policy is HostKeyPolicy.ACCEPT_NEW:
        log.warning("host key policy accept-new: unknown host keys will be recorded")
        console.err.print("warning: --host-key-policy accept-new records unknown host keys", markup=False)
    return partial(connect, policy=policy, timeout=args.connect_timeout)


def register(sub: argparse._SubParsersAction, common: Any) -> None:
    p = sub.add_parser("deploy", help="converge hosts to the plan over SSH (units, env files, restarts)",
                       description="Plan each host from its real facts, upload only changed files atomically, "
                                   "daemon-reload once, restart only the instances whose unit or env changed, "
                                   "and wait for /health. Exit codes: 0 ok, 2 a host failed, 4 a host "
                                   "unreachable, 6 a host's deploy lock is held, 5 bad input.")
    common(p)
    _ssh_options(p)
    p.add_argument("-C", "--check", action="store_true", help="change nothing; report what would change")
    p.add_argument("-D", "--diff", action="store_true", help="show unified diffs (secrets as [REDACTED])")
    p.add_argument("--prune", action="store_true", help="remove units of instances no longer in the plan")
    p.add_argument("--any-errors-fatal", action="store_true", help="stop touching other hosts after a failure")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    p.add_argument("--startup-budget", "--health-timeout", dest="health_timeout", type=float, default=0.0,
                   metavar="S", help="seconds a (re)started instance may take to become ready (default: each "
                                     "host's vllm_startup_budget, 600 unless set)")
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {JSON_SCHEMA})")
    p.add_argument("--playbook", type=Path, metavar="FILE",
                   help="extra checks run after each restart (see playbooks/verify.yml)")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("verify", help="check running services: readiness, smoke test, log keywords, GPU balance",
                       description="Without restarting anything, check every instance: systemd state, its start-up "
                                   "log (the tensor parallel size vLLM really uses, context length, KV capacity, "
                                   "no fatal errors), /health, /v1/models, one small completion, and GPU balance. "
                                   "Exit codes: 0 all checks pass, 2 a check failed, 4 a host unreachable.")
    common(p)
    _ssh_options(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {JSON_SCHEMA})")
    p.add_argument("--junit", type=Path, metavar="FILE", help="also write JUnit XML for CI pipelines")
    p.add_argument("--playbook", type=Path, metavar="FILE",
                   help="extra checks: expect/forbid log patterns, streamed smoke test (playbooks/verify.yml)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("facts", help="what each host really has: GPUs, NVLink, systemd, units, model, vLLM",
                       description="Gather facts in one SSH round trip per host, read-only.")
    common(p)
    _ssh_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_facts)

    p = sub.add_parser("lock", help="show or break the deploy lock on hosts",
                       description="Every deploy holds a lock directory on each host while it works. A crashed "
                                   "deploy can leave it behind: --show names its holder, --break removes it.")
    common(p)
    _ssh_options(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--show", action="store_true")
    mode.add_argument("--break", dest="break_", action="store_true")
    p.set_defaults(func=cmd_lock)


def cmd_deploy(args: argparse.Namespace) -> int:
    _, ctx, hosts = _targets(args)
    options = Options(check=args.check, diff=args.diff, prune=args.prune, forks=args.forks,
                      any_errors_fatal=args.any_errors_fatal, lock_wait=args.lock_wait,
                      health_timeout=args.health_timeout, known_hosts=tuple(args.known_hosts),
                      command="ernie-deploy deploy" + (" --check" if args.check else ""))
    exp = load_playbook(args.playbook) if args.playbook else Expectations()
    with console.HostProgress("deploy" + (" (check mode)" if args.check else "")) as progress:
        results = Runner(ctx, _connector(args), options, progress.update, exp).run(hosts)
    if args.json:
        console.print_json({"schema": JSON_SCHEMA, "check": args.check, "exit_code": exit_code(results),
                            "hosts": [r.to_json() for r in results]})
    else:
        show_results(results, verbose=args.verbose)
        show_recap(results)
    return exit_code(results)


def cmd_verify(args: argparse.Namespace) -> int:
    _, ctx, hosts = _targets(args)
    options = Options(forks=args.forks, known_hosts=tuple(args.known_hosts), command="ernie-deploy verify")
    exp = load_playbook(args.playbook) if args.playbook else Expectations()
    with console.HostProgress("verify") as progress:
        results = Verifier(ctx, _connector(args), options, progress.update, exp).run(hosts)
    if args.junit:
        args.junit.write_text(to_junit({r.host: r.checks or [_unreached(r)] for r in results}))
    if args.json:
        console.print_json({"schema": JSON_SCHEMA, "command": "verify", "exit_code": exit_code(results),
                            "hosts": [r.to_json() for r in results]})
    else:
        show_checks(results, verbose=args.verbose)
        show_recap(results)
    return exit_code(results)


def _unreached(r: Any) -> CheckResult:
    return CheckResult("host", "fail", f"{r.status.value}: {r.message}", fix=r.hint)


def _each(args: argparse.Namespace, hosts: Sequence[Any], work: Any) -> list[tuple[str, Any, str | None]]:
    """Run work(session, host) on every host in parallel; (host, value, error) per host, in order."""
    connector = _connector(args)

    def one(host: Any) -> tuple[str, Any, str | None]:
        try:
            session = connector(target_for(host, args.known_hosts))
            try:
                return host.name, work(session, host), None
            finally:
                session.close()
        except DeployError as exc:
            return host.name, None, str(exc)

    with ThreadPoolExecutor(max_workers=max(1, args.forks)) as pool:
        return list(pool.map(one, hosts))


def cmd_facts(args: argparse.Namespace) -> int:
    _, ctx, hosts = _targets(args)

    def gather(session: Any, host: Any) -> Any:
        pre = plan_host(host, ctx)
        return parse_facts(session.run(gather_script(pre.model_path or "/nonexistent", pre.bin or "vllm"),
                                       label="gather facts").text)

    results = _each(args, hosts, gather)
    if args.json:
        console.print_json({"schema": "ernie-deploy/facts/v1",
                            "hosts": {h: {"facts": f.to_json() if f else None, "error": e} for h, f, e in results}})
    else:
        for host, facts, error in results:
            if error:
                console.out.print(f"{host}: {error}", markup=False)
                continue
            gpus = f"{len(facts.gpus)} × {facts.gpus[0].name} ({facts.gpus[0].memory_mib} MiB, driver " \
                   f"{facts.gpus[0].driver})" if facts.gpus else f"no GPUs ({facts.gpu_error})"
            link = {True: "NVLink", False: "PCIe only", None: "n/a"}[facts.nvlink]
            arch = (facts.model_config or {}).get("architectures") or facts.model_error
            console.out.print(f"{host}: {gpus}, {link}; systemd {facts.systemd_version}; vLLM "
                              f"{facts.vllm_version or facts.vllm_error}; model {arch}", markup=False)
            for unit in facts.units.values():
                console.out.print(f"    {unit.name}: {unit.active_state}/{unit.sub_state} pid {unit.main_pid} "
                                  f"restarts {unit.n_restarts}", markup=False)
    return 4 if any(e for _, _, e in results) else 0


def cmd_lock(args: argparse.Namespace) -> int:
    _, _, hosts = _targets(args)
    script = lock.BREAK_SCRIPT if args.break_ else lock.SHOW_SCRIPT
    results = _each(args, hosts, lambda session, host: session.run(script, label="lock").text.strip())
    for host, text, error in results:
        info = lock.parse_info(text) if text else None
        state = error or (("broke lock " if args.break_ else "lock ") + info.describe() if info else "no lock")
        console.out.print(f"{host}: {state}", markup=False)
    return 4 if any(e for _, _, e in results) else 0


__all__ = ["RemoteError", "register"]
