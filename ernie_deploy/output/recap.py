"""Human output of multi-host runs: per-host results and Ansible's PLAY RECAP."""

from __future__ import annotations

from collections.abc import Sequence

from ernie_deploy.checks.result import CheckResult
from ernie_deploy.orchestration.results import HostResult, Status, recap_counts
from ernie_deploy.orchestration.rollout import Report
from ernie_deploy.output import console
from ernie_deploy.output.problem import said
from ernie_deploy.output.report import STYLE
from ernie_deploy.planning.findings import Severity

# Findings printed by default; advice and info are -v detail (a run repeats them for every host and task).
LOUD = (Severity.ERROR, Severity.WARNING)
TIMED = ("drain", "stop", "gpu_release", "load", "ready", "rollback_ready")
COLOUR = {Status.OK: "green", Status.CHANGED: "yellow", Status.FAILED: "bold red", Status.UNREACHABLE: "bold red",
          Status.SKIPPED: "cyan", Status.LOCKED: "bold magenta"}


def show_results(results: Sequence[HostResult], verbose: int = 0, shown: set[tuple[str, str]] | None = None) -> None:
    """One line per host, then what an operator needs: the fix, changes, problems with cause and fix, rollbacks.
    -v adds the rest (advice and info findings, passing checks, the release, steps, remote commands). `shown`:
    findings already printed in this run (a playbook's tasks repeat a host's plan findings), printed once."""
    for r in results:
        ch = r.change
        console.out.print(f"[{COLOUR[r.status]}]{r.status.value}[/]: [bold]{r.host}[/] ({r.seconds:.1f}s) "
                          f"{said(r.status.value, r.message)}", markup=True, highlight=False)
        if r.hint:
            console.out.print(f"    fix: {r.hint}", markup=False)
        for f in r.findings:
            key = (r.host, f"[{f.code}] {f.message}")
            if (f.severity not in LOUD and not verbose) or (shown is not None and key in shown):
                continue
            if shown is not None:
                shown.add(key)
            console.out.print(f"    [{STYLE[f.severity]}]{f.severity.value}[/] [{f.code}] {f.message}", markup=True)
            if f.fix:
                console.out.print(f"      fix: {f.fix}", markup=False)
        for path in ch.changed_files:
            console.out.print(f"    changed: {path}", markup=False)
        for unit in ch.restarted + ch.started:
            verb = "restart" if unit in ch.restarted else "start"
            console.out.print(f"    {verb}: {unit} ({ch.reasons.get(unit, '')})", markup=False)
        for unit in ch.pruned:
            console.out.print(f"    prune: {unit}", markup=False)
        for unit in ch.leftover:
            if unit not in ch.pruned:
                console.out.print(f"    not in the plan: {unit} (remove with --prune)", markup=False)
        for path in ch.dropins:
            console.out.print(f"    drop-in: {path}", markup=False)
        for diff in ch.diffs:
            console.verbatim(diff)
        for line in r.evidence:
            console.out.print(f"    | {line}", markup=False)
        for line in ch.rollbacks:
            console.out.print(f"    rollback: {line}", markup=False)
        for c in r.checks if verbose else [c for c in r.checks if c.status != "pass"]:
            console.out.print(f"    {c.status} {_where(r.host, c)} {c.name}: {c.summary}", markup=False)
            if c.status != "pass":
                _cause_and_fix(c, "      ")
        if not verbose:
            continue
        if ch.release:
            console.out.print(f"    release: {ch.release}", markup=False)
        for s in r.steps:
            evidence = f": {'; '.join(s.evidence)}" if s.evidence else ""
            console.out.print(f"    step {s.name}: {s.status}{' (changed)' if s.changed else ''} "
                              f"{s.seconds:.2f}s{evidence}", markup=False)
        console.out.print(f"    remote commands: {r.commands} ({', '.join(r.command_log)})", markup=False)


def _cause_and_fix(c: CheckResult, indent: str) -> None:
    if c.cause:
        console.out.print(f"{indent}cause: {c.cause}", markup=False)
    if c.fix:
        console.out.print(f"{indent}fix: {c.fix}", markup=False)


def _where(host: str, check: CheckResult) -> str:
    """The header a check prints under: its instance, or its host for a check of the host as a whole."""
    return check.instance or f"host {host}"


MARK = {"pass": "[green]✓[/]", "warn": "[yellow]![/]", "fail": "[bold red]✗[/]"}


def show_checks(results: Sequence[HostResult], verbose: int = 0, shown: set[tuple[str, str]] | None = None) -> None:
    """verify's report: a line per host, then per host and instance each check that did not pass, with its
    evidence, cause and fix; -v lists every check."""
    show_results([r for r in results if not r.checks], verbose, shown)
    for r in results:
        if not r.checks:
            continue
        console.out.print(f"[{COLOUR[r.status]}]{r.status.value}[/]: [bold]{r.host}[/] ({r.seconds:.1f}s) "
                          f"{said(r.status.value, r.message)}", markup=True, highlight=False)
        header = None
        for c in r.checks if verbose else [c for c in r.checks if c.status != "pass"]:
            if _where(r.host, c) != header:
                header = _where(r.host, c)
                console.out.print(f"  {header}", markup=False)
            console.out.print(f"    {MARK[c.status]} {c.name}: ", markup=True, end="")
            console.out.print(c.summary, markup=False, highlight=False)
            if c.status != "pass" or verbose:
                for line in c.evidence[:12]:
                    console.out.print(f"        | {line}", markup=False, highlight=False)
            if c.status != "pass":
                _cause_and_fix(c, "        ")


def show_recap(results: Sequence[HostResult]) -> None:
    """Ansible's PLAY RECAP layout, so eyes and scripts used to it read it at once."""
    console.out.print("\nPLAY RECAP " + "*" * 69, markup=False)
    for r in results:
        c = recap_counts(r)
        console.out.print(f"{r.host:<26} : ok={c['ok']:<4} changed={c['changed']:<4} "
                          f"unreachable={c['unreachable']:<4} failed={c['failed']:<4} skipped={c['skipped']:<4}",
                          markup=False, highlight=False)


def show_rollout(report: Report, results: Sequence[HostResult], verbose: int = 0) -> None:
    """Batches, where the rollout stopped, and (-v) per-instance phase timings."""
    if report.refused:
        console.out.print("pre-flight: already down: " + "; ".join(report.refused), markup=False)
    names = ", ".join(report.balancers)
    if report.balancers and not report.driven:
        console.out.print(f"[bold yellow]--no-balancer: the balancers ({names}) were not driven[/]: requests they "
                          "sent to an instance while it restarted were lost", markup=True, highlight=False)
    elif report.balancers and verbose:
        console.out.print(f"balancers driven: {names} (drain before each restart, ready once it serves)",
                          markup=False)
    if report.balancer_problems:
        console.out.print("pre-flight: a balancer cannot be driven: " + "; ".join(report.balancer_problems),
                          markup=False)
    if report.how:
        console.out.print(f"rollout: {report.how}", markup=False)
    if report.gate:
        console.out.print(report.gate, markup=False)
    out = [f"{host} {unit}" for host, units in report.rotation.snapshot().items() for unit in units]
    if out:
        console.out.print("out of the load balancer (taken out before its restart, not put back): " + ", ".join(out)
                          + "; --resume puts each back once it serves", markup=False)
    if len(report.batches) > 1 or report.resumed:
        done = {k + 1 for k in report.done}
        for k, batch in enumerate(report.batches, 1):
            state = "done" if k in done else "not done"
            console.out.print(f"batch {k}: {', '.join(batch)} ({state})", markup=False)
    if report.stopped:
        later = "; continue later with --resume" if len(report.batches) > 1 else ""
        console.out.print(f"[bold red]{report.stopped}[/]{later}", markup=True, highlight=False)
    rows = [(r.host, unit, phases) for r in results for unit, phases in r.timings.items()]
    if rows and verbose:
        console.table("per-instance timings", ["instance", *TIMED],
                      [[f"{host} {unit}", *(f"{phases[p]:.1f}s" if p in phases else "-" for p in TIMED)]
                       for host, unit, phases in rows])
