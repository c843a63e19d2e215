"""`ernie-deploy run PLAYBOOK`: read and check the whole playbook, then run its plays; thin. The inventory's
balancers are planned once for the run and driven by its rolling tasks as `restart` drives them."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ernie_deploy.cli.remote import balancers, connector, selected, ssh_options
from ernie_deploy.errors import ConfigError, DeployError, ExitCode, InventoryError
from ernie_deploy.output.schemas import RUN_SCHEMA

if TYPE_CHECKING:
    from ernie_deploy.inventory.inventory import Host, Inventory
    from ernie_deploy.orchestration.playrun import TaskRun
    from ernie_deploy.orchestration.transport import Progress
    from ernie_deploy.playbook.schema import Play, Playbook, Task


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    from ernie_deploy.playbook.actions import ACTIONS
    skipped = sorted(name for name, action in ACTIONS.items() if not action.runs_in_check)
    p = sub.add_parser("run", help="run a playbook: plays of provision, converge, rolling, verify and more",
                       description="Read PLAYBOOK (a list of plays: hosts, vars, serial, canary, "
                                   "max_fail_percentage, any_errors_fatal, tags, tasks) and check all of it "
                                   "before any host is contacted; then run each play's tasks in order across "
                                   "its hosts. Actions: " + ", ".join(ACTIONS) + ". Restarts happen only where "
                                   "something changed unless a task says `always: true`. See "
                                   "docs/playbooks.md and playbooks/site.yml. Exit codes: 0 ok, 2 a host "
                                   "failed, 4 unreachable, 5 bad playbook or input, 6 locked, 130 interrupted.")
    p.add_argument("playbook", type=Path, metavar="PLAYBOOK", help="the playbook file, e.g. playbooks/site.yml")
    common(p)
    ssh_options(p)
    p.add_argument("-t", "--tags", action="append", default=[], metavar="T",
                   help="only tasks with one of these tags (comma-separated or repeated); every task is tagged "
                        "with its action's name too")
    p.add_argument("--skip-tags", action="append", default=[], metavar="T", help="leave out tasks with these tags")
    p.add_argument("-C", "--check", action="store_true",
                   help="change nothing: changing tasks say what they would do; " + ", ".join(skipped[:-1])
                        + f" and {skipped[-1]} tasks are skipped")
    p.add_argument("-D", "--diff", action="store_true", help="show unified diffs of files (secrets as [REDACTED])")
    p.add_argument("--allow-commands", action="store_true",
                   help="allow the playbook's `command` tasks (arbitrary commands as root on the hosts)")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for a held lock")
    p.add_argument("--templates", type=Path, metavar="DIR", help="your own vllm.service.j2 / vllm.env.j2")
    p.add_argument("--no-balancer", action="store_true",
                   help="leave the inventory's balancers (group vllm_balancers) alone: no drain before and no "
                        "ready after each restart of rolling and restart tasks, and converge and rolling tasks "
                        "apply no balancer configuration. Only for a balancer that is down or cannot be planned, "
                        "when you accept that requests it sends to an instance while that restarts are lost (the "
                        "output says the balancers were not driven)")
    p.add_argument("--list-tasks", action="store_true", help="list the plays and tasks that would run, then stop")
    p.add_argument("--json", action="store_true", help=f"machine-readable results (schema {RUN_SCHEMA})")
    p.set_defaults(func=cmd_run)


def _split(values: Sequence[str]) -> list[str]:
    return [t.strip() for v in values for t in v.split(",") if t.strip()]


def read(path: Path, inventory: Inventory, tags: Sequence[str], skip: Sequence[str]) -> Playbook:
    """The playbook with the tasks the tags select; every mistake raises before a host is touched."""
    from ernie_deploy.playbook.schema import load_playbook
    def pattern_problem(pattern: str) -> str | None:
        try:
            inventory.select(pattern)
        except InventoryError as exc:
            return exc.message + (f" ({exc.hint})" if exc.hint else "")
        return None

    return load_playbook(path, pattern_problem).selected(tags, skip)


def cmd_run(args: argparse.Namespace) -> int:
    from ernie_deploy.orchestration.playrun import PlaybookRunner, RunOptions
    from ernie_deploy.orchestration.results import exit_code
    from ernie_deploy.output.remote import say_stopped
    from ernie_deploy.output.run import confirm, show_run, show_tasks
    # Every host --limit selects, balancers included: a play's converge and rolling tasks apply their configuration.
    inventory, ctx, _ = selected(args)
    book = read(args.playbook, inventory, _split(args.tags), _split(args.skip_tags))
    tasks = [(p, t) for p in book.plays for t in p.tasks]
    if not tasks:
        raise DeployError("the tags select no task of the playbook", where=str(args.playbook),
                          hint=f"its tags: {', '.join(sorted(book.tags))}")
    commands = [t for _, t in tasks if t.action == "command"]
    if commands and not args.allow_commands:
        raise ConfigError(f"{len(commands)} task(s) run commands on the hosts ({commands[0].name!r}, "
                          f"{commands[0].where})", where=str(args.playbook),
                          hint="review them, then rerun with --allow-commands (or --skip-tags command)")
    interactive = sys.stdin.isatty() and not args.json
    prompts = [t for _, t in tasks if t.action == "pause" and "prompt" in t.args]
    if prompts and not interactive and not args.check:
        raise ConfigError(f"task {prompts[0].name!r} ({prompts[0].where}) waits for a confirmation, but there is no "
                          "terminal to ask on", where=str(args.playbook),
                          hint="run it from a terminal, or use `pause: {seconds: N}` in unattended runs")
    if args.list_tasks:
        show_tasks(book)
        return ExitCode.OK
    with balancers(args, inventory, ctx) as lb:
        options = RunOptions(base_dir=args.inventory.base_dir, check=args.check, diff=args.diff,
                             forks=args.forks, lock_wait=args.lock_wait, known_hosts=tuple(args.known_hosts),
                             templates=args.templates, limit=args.limit,
                             command=f"ernie-deploy run {args.playbook.name}" + (" --check" if args.check else ""),
                             balancer_hosts=lb.names, balancer_plans=lb.plans, balancers=lb.control)
        runner = PlaybookRunner(inventory, ctx, connector(args), options, _starter(args), _finished(args),
                                confirm=confirm if interactive else None)
        records = runner.run(book)
    results = [r for rec in records for r in rec.results]
    code = exit_code(results, runner.stopped_by)
    if code == ExitCode.OK and runner.ended:
        code = ExitCode.FAILED
    say_stopped(runner.stopped_by)
    show_run(args.playbook, records, code, runner.ended, check=args.check, json=args.json)
    return code


def _starter(args: argparse.Namespace) -> Any:
    from ernie_deploy.output import console
    from ernie_deploy.output.run import show_header

    @contextlib.contextmanager
    def start(play: Play, task: Task, hosts: Sequence[Host]) -> Iterator[Progress]:
        if not args.json:
            show_header(play.name, task, check=args.check)
        with console.HostProgress(task.name) as progress:
            yield progress.update

    return start


def _finished(args: argparse.Namespace) -> Any:
    from ernie_deploy.output.run import show_task

    shown: set[tuple[str, str]] = set()  # each host's findings print once, not once per task

    def show(rec: TaskRun) -> None:
        if not args.json:
            show_task(rec, check=args.check, verbose=args.verbose, shown=shown)

    return show
