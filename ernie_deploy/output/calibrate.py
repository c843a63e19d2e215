"""What `calibrate` prints: per canary its candidates (tried with their numbers and verdicts, skipped with the
planner's reason, left out by the bound), the winner, the restore, and the table file written; or the calibrate
JSON. With --check, the canaries and candidates only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ernie_deploy.orchestration.calibrate import Calibration, Canary, Trial
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.output import console
from ernie_deploy.output.remote import host_error
from ernie_deploy.output.schemas import CALIBRATE_SCHEMA
from ernie_deploy.planning.calibrate import gpu_class


def show_calibrate(results: Sequence[HostResult], canaries: Sequence[Canary], calibrations: Sequence[Calibration],
                   code: int, *, json: bool, table_out: Path | None, check: bool) -> None:
    by_host = {c.host: c for c in calibrations}
    if json:
        hosts = {}
        for canary in canaries:
            name = canary.host.name
            doc = by_host[name].to_json() if name in by_host else Calibration(canary).to_json()
            result = next((r for r in results if r.host == name), None)
            doc |= {"tried": [c.to_json() for c in canary.grid.tried]} if check else {}
            if result is not None:
                doc |= {"status": result.status.value, "message": result.message, "hint": result.hint}
            hosts[name] = doc
        console.print_json({"schema": CALIBRATE_SCHEMA, "check": check, "exit_code": code,
                            "table_out": str(table_out) if table_out else None, "hosts": hosts})
        return
    for canary in canaries:
        _canary(canary, by_host.get(canary.host.name), next((r for r in results if r.host == canary.host.name), None))
    if table_out is not None:
        _line(f"measured row(s) written to {table_out}: `ernie-deploy plan --table {table_out}` uses them")
    elif not check:
        _line("nothing written")


def _canary(canary: Canary, cal: Calibration | None, result: HostResult | None) -> None:
    also = f"; stands for {', '.join(canary.stands_for)}" if canary.stands_for else ""
    w, slo = canary.spec.workload, canary.spec.slo
    limits = ", ".join(f"{k} {v:g}" for k, v in slo.to_json().items() if v is not None)
    _line(f"{canary.host.name} ({gpu_class(canary.plan)}{also})")
    _line(f"    workload: {w.num_prompts} prompts of {w.input_len}+{w.output_len} tokens; SLOs: {limits}")
    if cal is None or not cal.trials:
        for c in canary.grid.tried:
            _line(f"    candidate: {c.label()}")
    else:
        console.table(None, ["candidate", "status", "output tok/s", "TTFT p99 ms", "TPOT p99 ms", "why"],
                      [_trial(t) for t in cal.trials])
    for s in canary.grid.invalid:
        _line(f"    skipped (planner): {s.candidate.label()}: {s.reason}")
    if canary.grid.over:
        _line(f"    not tried (--max-candidates {len(canary.grid.tried)}): "
              + "; ".join(c.label() for c in canary.grid.over))
    if cal is not None and cal.stopped:
        _line(f"    stopped: {cal.stopped}")
    if result is not None:
        _line(f"    {host_error(result) or result.message}")


def _trial(t: Trial) -> list[str]:
    m = t.measurement

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return [t.candidate.label(), t.status.upper(), num(m.output_throughput if m else None),
            num(m.ttft_p99_ms if m else None), num(m.tpot_p99_ms if m else None), t.message]


def _line(text: str) -> None:
    console.out.print(text, markup=False, highlight=False)
