"""What `watch` prints: each round as it ends (hosts not read, instances not making progress with evidence and
fix, the healthy ones in a line, each restart decision), then how the watch ended; or, with --json, one document
at the end (schema WATCH_SCHEMA)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.orchestration.watch import Decision, Round, Seen, WatchReport, WatchView
from ernie_deploy.output import console
from ernie_deploy.output.jsonout import host_json
from ernie_deploy.output.problem import host_problem
from ernie_deploy.output.schemas import WATCH_SCHEMA

if TYPE_CHECKING:  # at run time it would load SSH (paramiko) into every command's --help
    from ernie_deploy.orchestration.transport import Progress


def _line(text: str) -> None:
    console.out.print(text, markup=False, highlight=False)


class ConsoleView(WatchView):
    """Rounds and restarts on the terminal as they happen (nothing with --json: the document says it all)."""

    def __init__(self, *, json: bool, verbose: bool) -> None:
        self.json, self.verbose = json, verbose

    @contextmanager
    def _progress(self, title: str) -> Iterator[Progress | None]:
        with console.HostProgress(title) as progress:
            yield progress.update

    def reading(self, number: int) -> AbstractContextManager[Progress | None]:
        return self._progress(f"watch: round {number}")

    def restarting(self, host: str, unit: str) -> AbstractContextManager[Progress | None]:
        return self._progress(f"watch: restarting {host} {unit}")

    def round_done(self, done: Round) -> None:
        if not self.json:
            show_round(done, verbose=self.verbose)


def show_round(done: Round, *, verbose: bool) -> None:
    sick, healthy = done.sick, [s for s in done.seen if s.healthy]
    _line(f"round {done.number} at {done.at:.0f}s: {len(done.seen)} instance(s) read, {len(healthy)} healthy"
          + (f", {len(sick)} not" if sick else ""))
    for r in done.hosts:
        if r.finished:
            _line(host_problem(r.host, r.message, r.hint, indent="  "))
    for s in sick:
        _seen(s)
        for d in done.decisions:
            if (d.host, d.unit) == s.key:
                _decision(d, verbose)
    if healthy:
        if verbose:
            for s in healthy:
                _line(f"  {s.host} {s.unit} ({s.model}): {s.state}: {s.progress.evidence}")
        else:
            _line("  healthy: " + ", ".join(f"{s.host} {s.unit} {s.state}" for s in healthy))
    for s in healthy:
        if s.death is not None:  # it died and systemd brought it back: the watch says so once it serves
            _line(f"  {s.host} {s.unit} ({s.model}): {s.death.text}")


def _seen(s: Seen) -> None:
    if not s.active and s.death is not None:
        _line(f"  {s.host} {s.unit} ({s.model}): {s.state}: {s.death.text}")
        if s.death.fix:
            _line(f"    fix: {s.death.fix}")
        return
    evidence = s.progress.evidence if s.active else f"systemd does not run it; {s.progress.evidence}"
    _line(f"  {s.host} {s.unit} ({s.model}): {s.state}: {evidence}")
    if s.progress.fix:
        _line(f"    fix: {s.progress.fix}")


def _decision(d: Decision, verbose: bool) -> None:
    label = {"restarted": "restarted", "failed": "restart FAILED", "interrupted": "restart interrupted",
             "not-restarted": "watchdog"}[d.outcome]
    _line(f"    {label}: {d.message}")
    if d.result is not None:
        for line in d.result.change.rollbacks:
            _line(f"      {line}")
        if verbose:
            for step in d.result.steps:
                _line(f"      step {step.name}: {step.status} ({step.seconds:.1f}s)")
    if d.fix and d.outcome != "restarted":
        _line(f"      fix: {d.fix}")


def show_end(report: WatchReport, *, json: bool) -> None:
    if json:
        console.print_json(watch_document(report))
        return
    last = report.rounds[-1] if report.rounds else None
    restarts = report.restarts
    _line(f"watch ended ({report.ended or 'not started'}) after {len(report.rounds)} round(s)"
          + (f", {last.at:.0f}s after the first" if last is not None and last.number > 1 else "")
          + f"; {len(restarts)} restart(s)"
          + "".join(f"; {d.host} {d.unit} {d.outcome} in round {d.round}" for d in restarts))
    for r in report.results:
        _line(host_problem(r.host, r.message, r.hint, indent="  ") if r.finished
              else f"  {r.host}: {r.status.value}: {r.message}")
    _line(f"exit code {report.code}")


def _host(r: HostResult) -> dict[str, Any]:
    return {"host": r.host, "status": r.status.value, "message": r.message, "hint": r.hint}


def watch_document(report: WatchReport) -> dict[str, Any]:
    opts = report.options
    return {
        "schema": WATCH_SCHEMA, "exit_code": report.code, "ended": report.ended,
        "for_s": opts.seconds, "every_s": opts.every, "once": opts.once, "restart_stalled": opts.restart_stalled,
        "max_restarts": opts.max_restarts,
        "rounds": [{"round": r.number, "at_s": r.at, "hosts": [_host(h) for h in r.hosts],
                    "instances": [s.to_json() for s in r.seen],
                    "decisions": [{**d.to_json(), "result": host_json(d.result) if d.result else None}
                                  for d in r.decisions]} for r in report.rounds],
        "end": {"hosts": [_host(r) for r in report.results],
                "instances": [s.to_json() for s in report.rounds[-1].seen] if report.rounds else []},
    }
