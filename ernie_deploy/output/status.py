"""What `status` and `logs` print: each host's instances and drift with fixes (or the status JSON), and an
instance's journal lines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ernie_deploy.orchestration.details import StatusReport
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.output import console
from ernie_deploy.output.remote import host_error
from ernie_deploy.output.schemas import STATUS_SCHEMA


def show_status(results: Sequence[HostResult], reports: Mapping[str, StatusReport], code: int, *, json: bool) -> None:
    """`reports` holds the hosts that were read; the others show their error."""
    if json:
        console.print_json({"schema": STATUS_SCHEMA, "exit_code": code, "hosts": {
            r.host: {"error": None if r.host in reports else host_error(r) or r.message,
                     **(reports[r.host].to_json() if r.host in reports else {})} for r in results}})
        return
    for r in results:
        report = reports.get(r.host)
        if report is None:
            console.out.print(host_error(r) or f"{r.host}: {r.message}", markup=False, highlight=False)
            for f in r.findings:
                console.out.print(f"    {f.severity.value} [{f.code}] {f.message}", markup=False, highlight=False)
            continue
        changed = report.last_change_line()
        console.out.print(f"{r.host}: vLLM {report.vllm_line()}, release {report.release or '(none matches)'}, "
                          f"last change {changed}, lock {report.lock or 'free'}", markup=False, highlight=False)
        for inst in report.instances:
            up = f"up {inst['uptime_s']:.0f}s" if inst["uptime_s"] is not None else "not up"
            runs = f" vLLM {inst['vllm']}" if inst.get("vllm") else ""
            console.out.print(f"    {inst['unit']}: {inst['state']} pid {inst['pid']}{runs} {up} restarts "
                              f"{inst['restarts']} health {inst['health'] or '-'} (GPUs "
                              f"{','.join(map(str, inst['gpus']))}, port {inst['port']})", markup=False,
                              highlight=False)
        for d in report.drift:
            console.out.print(f"    drift [{d.kind}] {d.message}", markup=False, highlight=False)
            console.out.print(f"      fix: {d.fix}", markup=False, highlight=False)
        if not report.drift:
            console.out.print("    no drift", markup=False)


def show_log_header(host: str, unit: str, invocation: str | None, *, previous: bool) -> None:
    console.err.print(f"{host} {unit}, run {invocation}" + (" (the previous one)" if previous else ""), markup=False)


def show_log_lines(lines: Sequence[str]) -> None:
    for line in lines:
        console.verbatim(line + "\n")
