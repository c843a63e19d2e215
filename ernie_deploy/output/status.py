"""What `status` and `logs` print: each host's instances (with their progress and their servers' state on each
balancer) and drift with fixes (an instance making no progress among them), each balancer's row (or the status
JSON), and an instance's journal lines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ernie_deploy.orchestration.details import Drift, StatusReport
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.orchestration.status import BalancerReport
from ernie_deploy.output import console
from ernie_deploy.output.remote import host_error
from ernie_deploy.output.schemas import STATUS_SCHEMA


def show_status(results: Sequence[HostResult], reports: Mapping[str, StatusReport], code: int, *, json: bool,
                balancers: Mapping[str, BalancerReport] | None = None, verbose: bool = False) -> None:
    """`reports` holds the vLLM hosts that were read, the others show their error; `balancers` the balancer
    hosts' rows (their results are among `results` too, for the exit code)."""
    lbs = balancers or {}
    if json:
        console.print_json({"schema": STATUS_SCHEMA, "exit_code": code, "hosts": {
            r.host: {"error": None if r.host in reports else host_error(r) or r.message,
                     **(reports[r.host].to_json() if r.host in reports else {})} for r in results if r.host not in lbs},
            "balancers": {name: b.to_json() for name, b in lbs.items()}})
        return
    for r in results:
        if r.host in lbs:
            continue
        report = reports.get(r.host)
        if report is None:
            _line(host_error(r) or f"{r.host}: {r.message}")
            for f in r.findings:
                _line(f"    {f.severity.value} [{f.code}] {f.message}")
            continue
        changed = report.last_change_line()
        _line(f"{r.host}: vLLM {report.vllm_line()}, release {report.release or '(none matches)'}, "
              f"last change {changed}, lock {report.lock or 'free'}")
        for inst in report.instances:
            up = f"up {inst['uptime_s']:.0f}s" if inst["uptime_s"] is not None else "not up"
            runs = f" vLLM {inst['vllm']}" if inst.get("vllm") else ""
            _line(f"    {inst['unit']}: {inst['state']} pid {inst['pid']}{runs} {up} restarts {inst['restarts']} "
                  f"health {inst['health'] or '-'} progress {_progress(inst.get('progress'))} "
                  f"(GPUs {','.join(map(str, inst['gpus']))}, port {inst['port']})")
            if inst.get("death") and inst["serving"]:  # a down one's story is its drift
                _line(f"      {inst['death']['text']}")
            if inst["balancers"]:
                _line("      balancers: " + ", ".join(f"{lb} {_server_state(seen, verbose)}"
                                                      for lb, seen in inst["balancers"].items()))
        _drift(report.drift)
    for b in lbs.values():
        _balancer(b, verbose)


def _progress(seen: Mapping[str, Any] | None) -> str:
    """An instance's progress state; an unhealthy one's evidence and fix are its drift lines. Not read: "-"."""
    return "-" if seen is None else str(seen["state"])


def _line(text: str) -> None:
    console.out.print(text, markup=False, highlight=False)


def _drift(drift: Sequence[Drift]) -> None:
    for d in drift:
        _line(f"    drift [{d.kind}] {d.message}")
        _line(f"      fix: {d.fix}")
    if not drift:
        _line("    no drift")


def _server_state(seen: Mapping[str, Any], verbose: bool) -> str:
    """A server as one balancer sees it: HAProxy's status word, with sessions and weight in -v."""
    if seen["configured"] is None:
        return "? (not read)"
    if not seen["configured"]:
        return "not configured"
    return str(seen["status"]) + (f" ({seen['sessions']} sessions, weight {seen['weight']})" if verbose else "")


def _balancer(b: BalancerReport, verbose: bool) -> None:
    head = f"{b.host}: {b.plan.kind} on {b.plan.bind}:{b.plan.port}"
    if b.problem is not None:
        _line(f"{head}, not read: {b.problem}")
        return
    servers = b.to_json()["servers"]
    _line(f"{head}, {b.up} of {len(b.plan.servers())} planned server(s) UP")
    for backend in b.plan.backends:
        _line(f"    backend {backend.name} (model {backend.model}): "
              + ", ".join(f"{s.name} {_server_state(servers[s.name], verbose)}" for s in backend.servers))
    _drift(b.drift)


def show_log_header(host: str, unit: str, invocation: str | None, *, previous: bool) -> None:
    console.err.print(f"{host} {unit}, run {invocation}" + (" (the previous one)" if previous else ""), markup=False)


def show_log_lines(lines: Sequence[str]) -> None:
    for line in lines:
        console.verbatim(line + "\n")
