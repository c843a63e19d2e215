"""Command line: the parser, the planning commands (plan, render, explain, inventory) and the one error
handler. Exit codes are `errors.ExitCode`; an error that ends a command exits with its `exit_code`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from ernie_deploy.inventory.inventory import Host, Inventory
    from ernie_deploy.planning.balancer import BalancerPlan
    from ernie_deploy.planning.plan import PlanContext
    from ernie_deploy.planning.plantypes import HostPlan
    from ernie_deploy.planning.render import RenderedFile
from ernie_deploy.cli.bench import register as register_bench
from ernie_deploy.cli.calibrate import register as register_calibrate
from ernie_deploy.cli.export import register as register_export
from ernie_deploy.cli.files import swap_in
from ernie_deploy.cli.inventories import add_inventory_options
from ernie_deploy.cli.lab import register as register_lab
from ernie_deploy.cli.provision import register as register_provision
from ernie_deploy.cli.remote import register as register_remote
from ernie_deploy.cli.run import register as register_run
from ernie_deploy.cli.status import register as register_status
from ernie_deploy.cli.watch import register as register_watch
from ernie_deploy.errors import DeployError, ExitCode
from ernie_deploy.output.schemas import PLAN_SCHEMA

log = logging.getLogger("ernie_deploy")
BALANCER_FILE = "haproxy.cfg"  # render writes each balancer's configuration to OUT/balancers/HOST/haproxy.cfg


def _common(p: argparse.ArgumentParser, limit: bool = True) -> None:
    # Accepted after the command too (`deploy -v`), where operators type it.
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="-v: the detail (passing checks, advice and info findings, steps, timings, remote "
                        "commands); -vvv: tracebacks")
    add_inventory_options(p)
    if limit:
        p.add_argument("-l", "--limit", metavar="PATTERN",
                       help="Ansible host pattern: names, groups, globs, a:b union, a:&b intersection, a:!b exclusion")
    p.add_argument("--table", type=Path, metavar="FILE",
                   help="recommended-config table to use instead of the bundled one")


class _Formatter(argparse.HelpFormatter):
    """--help names each option's default where it has one worth saying (not None, False or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or default in (None, False, [], "")
                or default is argparse.SUPPRESS or not action.option_strings):
            return action.help
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors; 2 means "a host failed" here, so usage errors exit 5."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(ExitCode.INPUT, f"{self.prog}: error: {message}\n")


def _commit(version: str) -> str:
    """The commit a build came from, as hatch-vcs writes it into the version (0.1.1.dev150+ge2f882a18...)."""
    import re
    found = re.search(r"\+g([0-9a-f]{7,40})", version)
    return f" (commit {found.group(1)})" if found else ""


def build_parser() -> argparse.ArgumentParser:
    from ernie_deploy import __version__
    parser = _Parser(
        prog="ernie-deploy",
        description="Plan, render and deploy vLLM services (ERNIE-4.5 or any Hugging Face model) on GPU hosts.",
        epilog="Exit codes: 0 ok · 1 a plan has errors · 2 a host failed · 4 a host unreachable · 5 bad input or "
               "usage · 6 a deploy lock is held · 130 interrupted (143 SIGTERM).",
    )
    parser.add_argument("--version", action="version", version=f"ernie-deploy {__version__}{_commit(__version__)}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v shows the detail (passing checks, advice and info findings, steps, timings); "
                             "-vvv prints tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("plan", help="validate and explain the plan of every host (touches no host)",
                       description="Match each host to the recommended-config table, validate the result the "
                                   "way vLLM would, and show memory estimates and findings with fixes. Hosts of "
                                   "group vllm_balancers are balancers: each shows where HAProxy listens and, per "
                                   "served model, the servers (every vLLM instance of the inventory) and weights.")
    _common(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {PLAN_SCHEMA})")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("render", help="write the systemd units and env files of every host to a directory",
                       description="Render OUT/HOST/etc/systemd/system/*.service and OUT/HOST/etc/ernie-deploy/*.env "
                                   "(mode 0600), and for each balancer (group vllm_balancers) OUT/balancers/HOST/"
                                   "haproxy.cfg (mode 0600 when it holds the API key). Hosts whose plan has errors "
                                   "get nothing.")
    _common(p)
    p.add_argument("-o", "--output", required=True, type=Path, metavar="DIR", help="output directory")
    p.add_argument("--templates", type=Path, metavar="DIR",
                   help="your own template directory (vllm.service.j2, vllm.env.j2)")
    p.add_argument("--json", action="store_true", help="list written files as JSON")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("explain", help="why every setting of a host has its value",
                       description="Show each setting with its source: table default, profile, row, inventory "
                                   "variable or computed fallback, and the balancers that front the host's "
                                   "instances; for a balancer host, its variables and what it fronts.")
    _common(p, limit=False)
    p.add_argument("host", help="inventory host name")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("inventory", help="show the inventory exactly as ansible-inventory would",
                       description="Same output as `ansible-inventory -i INV --list|--host|--graph`, so the two "
                                   "can be diffed, except that a secret's plain value (vllm_api_key, hf_token, ...) "
                                   "shows as [REDACTED]; vault ciphertext and {{ templates }} show as they are.")
    add_inventory_options(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="all groups and host variables as JSON")
    mode.add_argument("--host", metavar="HOST", help="one host's variables as JSON")
    mode.add_argument("--graph", nargs="?", const="all", metavar="GROUP", help="the group tree")
    p.add_argument("--vars", action="store_true", help="with --graph: show variables")
    p.set_defaults(func=cmd_inventory)

    register_remote(sub, _common)
    register_provision(sub, _common)
    register_run(sub, _common)
    register_status(sub, _common)
    register_watch(sub, _common)
    register_bench(sub, _common)
    register_calibrate(sub, _common)
    register_export(sub, _common)
    register_lab(sub)
    return parser


def _load(args: argparse.Namespace) -> tuple[Inventory, PlanContext]:
    from ernie_deploy.cli.inventories import load
    from ernie_deploy.planning.plan import PlanContext
    inventory = load(args)
    ctx = PlanContext.load(args.table, base_dir=args.inventory.base_dir)
    return inventory, ctx


def _plans(args: argparse.Namespace) -> tuple[list[HostPlan], list[BalancerPlan], dict[str, DeployError]]:
    """The selected vLLM hosts' plans, and the selected balancers' plans (or why each cannot be planned)."""
    from ernie_deploy.planning.balancer import split_hosts
    from ernie_deploy.planning.plan import plan_hosts
    inventory, ctx = _load(args)
    vllm_hosts, balancer_hosts = split_hosts(inventory.select(args.limit))
    plans = plan_hosts(list(vllm_hosts), ctx)
    balancers, failed = _balancers(inventory, ctx, balancer_hosts, plans)
    return plans, balancers, failed


def _balancers(inventory: Inventory, ctx: PlanContext, hosts: Sequence[Host], planned: Sequence[HostPlan]
               ) -> tuple[list[BalancerPlan], dict[str, DeployError]]:
    """Each balancer host's plan, fronting every vLLM host of the inventory whatever --limit selected; a
    balancer that cannot be planned is reported and does not hide the others."""
    from ernie_deploy.planning.balancer import fleet_plans, plan_balancers
    if not hosts:
        return [], {}
    fleet = fleet_plans(inventory.hosts.values(), ctx, planned)
    plans: list[BalancerPlan] = []
    failed: dict[str, DeployError] = {}
    for host in hosts:
        try:
            plans += plan_balancers([host], fleet, ctx.base_dir)
        except DeployError as exc:
            failed[host.name] = exc
    return plans, failed


def cmd_plan(args: argparse.Namespace) -> int:
    from ernie_deploy.output.report import show_plan_command
    plans, balancers, failed = _plans(args)
    show_plan_command(plans, json=args.json, verbose=args.verbose > 0, balancers=balancers, balancer_failures=failed)
    return ExitCode.OK if all(p.ok for p in plans) and not failed else ExitCode.PLAN_ERRORS


def cmd_render(args: argparse.Namespace) -> int:
    from ernie_deploy.output.report import show_render
    from ernie_deploy.planning.balancer import render_balancer
    from ernie_deploy.planning.render import render_hosts, unit_environment
    plans, balancers, failed_balancers = _plans(args)
    env = unit_environment(args.templates)
    rendered, failed = render_hosts(plans, env)
    args.output.mkdir(parents=True, exist_ok=True)
    written = []
    for host, files in rendered.items():
        written += _write_host(args.output, host, files)
    failed.update(failed_balancers)
    for balancer in balancers:
        try:
            config = render_balancer(balancer)
        except DeployError as exc:
            failed[balancer.host] = exc
            continue
        # The configuration carries the instances' API key when they have one: readable by its owner only then.
        mode = 0o600 if any(b.api_key is not None for b in balancer.backends) else 0o644
        swap_in(args.output / "balancers" / balancer.host, [(BALANCER_FILE, config, mode)])
        written.append(str(args.output / "balancers" / balancer.host / BALANCER_FILE))
    show_render(written, failed, json=args.json)
    return ExitCode.PLAN_ERRORS if failed else ExitCode.OK


def _write_host(out: Path, host: str, files: list[RenderedFile]) -> list[str]:
    """Write one host's files into a fresh directory, then swap it in: never a half-written host."""
    swap_in(out / host, [(f.path.lstrip("/"), f.content, f.mode) for f in files])
    return [str(out / host / f.path.lstrip("/")) for f in files]


def cmd_explain(args: argparse.Namespace) -> int:
    from ernie_deploy.output.balancer import show_balancer_explain
    from ernie_deploy.output.report import show_explain_command
    from ernie_deploy.planning.balancer import balancer_settings, is_balancer, split_hosts
    from ernie_deploy.planning.plan import plan_hosts
    inventory, ctx = _load(args)
    if args.host not in inventory.hosts:
        raise DeployError(f"no host {args.host!r} in the inventory", where=args.inventory.shown,
                          hint="run `ernie-deploy inventory -i INV --graph` to list the hosts")
    host = inventory.hosts[args.host]
    _, balancer_hosts = split_hosts(inventory.hosts.values())
    if is_balancer(host):
        settings = balancer_settings(host, ctx.base_dir)
        planned, failed = _balancers(inventory, ctx, [host], ())
        show_balancer_explain(host.name, settings, planned[0] if planned else None, failed.get(host.name),
                              json=args.json, schema=PLAN_SCHEMA)
        return ExitCode.PLAN_ERRORS if failed else ExitCode.OK
    (plan,) = plan_hosts([host], ctx)
    show_explain_command(plan, json=args.json, balancers=[h.name for h in balancer_hosts])
    return ExitCode.OK if plan.ok else ExitCode.PLAN_ERRORS


def cmd_inventory(args: argparse.Namespace) -> int:
    from ernie_deploy.cli.inventories import load_raw
    from ernie_deploy.output.inventory import show_ansible_json, show_graph
    from ernie_deploy.planning.settings import redacted_secrets
    # As ansible-inventory shows it, but a secret's plain value is [REDACTED] (vault ciphertext and templates show).
    inventory = load_raw(args).redacted(redacted_secrets)
    if args.graph:
        show_graph(inventory.graph(args.graph, with_vars=args.vars))
    else:
        show_ansible_json(inventory.ansible_list() if args.list else inventory.ansible_host(args.host))
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose >= 3 else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # paramiko logs a lost or refused connection with its traceback at ERROR; the host's result already names
    # the failure, its cause and fix, so the traceback is detail for -vvv only.
    logging.getLogger("paramiko").setLevel(logging.NOTSET if args.verbose >= 3 else logging.CRITICAL)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        return _reader_gone()
    except DeployError as exc:
        if args.verbose >= 3:
            log.exception("error")
        from ernie_deploy.output import console  # rich: only where something is printed through it
        console.error(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        from ernie_deploy.output import console
        console.note("interrupted")
        return ExitCode.INTERRUPTED


def _reader_gone() -> int:
    """The reader of stdout went away (`ernie-deploy plan | head`): stop quietly, as other command-line tools
    do. Python's "Note on SIGPIPE" (docs.python.org/3/library/signal.html#note-on-sigpipe): point stdout at
    /dev/null so the flush at exit cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (under a test's capture): nothing to flush
        pass
    return ExitCode.BROKEN_PIPE
