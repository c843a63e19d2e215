"""What `run` prints: the task list, each task's header and results as it ends, the PLAY RECAP (counted in
tasks, as ansible-playbook does), or the run JSON; and the prompt of a `pause` task."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from ernie_deploy.orchestration.details import ProvisionReport
from ernie_deploy.orchestration.playrun import TaskRun, action_line
from ernie_deploy.orchestration.results import HostResult, Status
from ernie_deploy.orchestration.steps import StepStatus
from ernie_deploy.output import console
from ernie_deploy.output.jsonout import host_json
from ernie_deploy.output.recap import show_checks, show_results, show_rollout
from ernie_deploy.output.schemas import RUN_SCHEMA
from ernie_deploy.playbook.schema import Playbook, Task


def show_tasks(book: Playbook) -> None:
    for play in book.plays:
        console.out.print(f"play {play.name!r} (hosts: {play.hosts})", markup=False, highlight=False)
        for t in play.tasks:
            console.out.print(f"    {t.name}  [{t.action}]  tags: {', '.join(sorted(t.tags))}", markup=False,
                              highlight=False)


def show_header(play: str, task: Task, *, check: bool) -> None:
    console.out.print(f"\nTASK [{play} : {task.name}] ({task.action})" + (" (check mode)" if check else ""),
                      markup=False, highlight=False)


def show_task(rec: TaskRun, *, check: bool, verbose: int, shown: set[tuple[str, str]] | None = None) -> None:
    """A task's results as it ends, so a long playbook shows its progress as it goes: a line per host, changes
    and problems (-v: every step). `shown`: the findings earlier tasks printed, not repeated."""
    if rec.note:
        show_header(rec.play, rec.task, check=check)
        console.out.print(f"[cyan]skipped[/]: {rec.note}", markup=True, highlight=False)
        return
    results = rec.results if verbose or rec.task.action != "provision" else [_changes(r) for r in rec.results]
    if rec.task.action in ("verify", "gpu_check"):
        show_checks(results, verbose, shown)
    else:
        show_results(results, verbose, shown)
    if rec.report is not None:
        show_rollout(rec.report, rec.results, verbose)


def _changes(r: HostResult) -> HostResult:
    """A provision task's result without the lines of steps that found everything in place (-v shows them)."""
    ok = {action_line(a) for a in r.detail_of(ProvisionReport).actions if a["status"] == StepStatus.OK}
    return dataclasses.replace(r, evidence=[line for line in r.evidence if line not in ok])


def show_run(playbook: Path, records: Sequence[TaskRun], code: int, ended: str | None, *, check: bool,
             json: bool) -> None:
    hosts = _hosts(records)
    if json:
        console.print_json({"schema": RUN_SCHEMA, "playbook": str(playbook), "check": check,
                            "exit_code": code, "ended": ended,
                            "tasks": [{"play": rec.play, "task": rec.task.name, "action": rec.task.action,
                                       "where": rec.task.where, "note": rec.note or None,
                                       "hosts": [host_json(r) for r in rec.results]} for rec in records],
                            "recap": {h: _counts(records, h) for h in hosts}})
        return
    if ended:
        console.out.print(f"[bold red]stopped:[/] {ended}", markup=True, highlight=False)
    console.out.print("\nPLAY RECAP " + "*" * 69, markup=False)
    for host in hosts:
        c = _counts(records, host)
        console.out.print(f"{host:<26} : ok={c['ok']:<4} changed={c['changed']:<4} unreachable={c['unreachable']:<4} "
                          f"failed={c['failed']:<4} skipped={c['skipped']:<4}", markup=False, highlight=False)


def confirm(prompt: str) -> bool:
    """A `pause: {prompt: ...}` task: True once the operator pressed Enter."""
    console.err.print(f"{prompt} [Enter to continue, Ctrl-C to stop] ", markup=False, end="")
    try:
        input()
    except EOFError:
        return False
    return True


def _hosts(records: Sequence[TaskRun]) -> list[str]:
    seen: dict[str, None] = {}
    for rec in records:
        for r in rec.results:
            seen.setdefault(r.host, None)
    return list(seen)


def _counts(records: Sequence[TaskRun], host: str) -> dict[str, int]:
    """Ansible's recap columns, counted in tasks: ok (ran fine, changed or not), changed, failed, ..."""
    c = dict.fromkeys(("ok", "changed", "unreachable", "failed", "skipped"), 0)
    for rec in records:
        for r in rec.results:
            if r.host != host:
                continue
            if r.status in (Status.OK, Status.CHANGED):
                c["ok"] += 1
            c["changed"] += r.status is Status.CHANGED
            c["unreachable"] += r.status is Status.UNREACHABLE
            c["failed"] += r.status in (Status.FAILED, Status.LOCKED)
            c["skipped"] += r.status is Status.SKIPPED
    return c
