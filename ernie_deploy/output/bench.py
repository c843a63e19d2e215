"""What `bench` prints: per instance a table of what vllm bench serve measured and each SLO's verdict, the hosts
that could not be benched with why; or the bench JSON with vLLM's raw result kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ernie_deploy.orchestration.bench import InstanceBench
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.output import console
from ernie_deploy.output.remote import host_error
from ernie_deploy.output.schemas import BENCH_SCHEMA
from ernie_deploy.planning.bench import BenchResult


def show_bench(results: Sequence[HostResult], reports: Mapping[str, Sequence[InstanceBench]], code: int, *,
               json: bool, save_dir: Path) -> None:
    if json:
        console.print_json({"schema": BENCH_SCHEMA, "exit_code": code, "saved_to": str(save_dir), "hosts": {
            r.host: {"status": r.status.value, "message": r.message, "hint": r.hint,
                     "findings": [f.to_json() for f in r.findings],
                     "instances": [b.to_json() for b in reports.get(r.host, ())]} for r in results}})
        return
    for r in results:
        benches = reports.get(r.host, ())
        if not benches:
            _line(host_error(r) or f"{r.host}: {r.message}")
            for f in r.findings:
                _line(f"    {f.severity.value} [{f.code}] {f.message}")
            continue
        for b in benches:
            _instance(r.host, b)
    saved = [b.saved for bs in reports.values() for b in bs if b.saved]
    if saved:
        _line(f"raw results: {len(saved)} file(s) under {save_dir}")


def _instance(host: str, b: InstanceBench) -> None:
    w = b.spec.workload
    rate = "all at once" if w.request_rate is None else f"{w.request_rate:g} req/s"
    conc = f", at most {w.max_concurrency} in flight" if w.max_concurrency is not None else ""
    _line(f"{host} {b.unit} ({b.served}, port {b.port}): {b.status.upper()}, {b.message}")
    _line(f"    workload: {w.num_prompts} random prompts of {w.input_len} tokens, {w.output_len} generated each, "
          f"{rate}{conc}, stopped after {w.timeout:g}s")
    if b.result is not None:
        console.table(None, ["measured", "value"], _rows(b.result))
    for v in b.verdicts:
        _line(f"    SLO {'pass' if v.ok else 'FAIL'}: {v.summary}")
    if b.saved:
        _line(f"    raw result: {b.saved}")


def _rows(r: BenchResult) -> list[list[str]]:
    def ms(metric: str, *stats: str) -> str:
        values = [r.metric(metric, s) for s in stats]
        return " / ".join("-" if v is None else f"{v:.1f}" for v in values) + " ms"

    def num(value: float | None, unit: str) -> str:
        return "-" if value is None else f"{value:.2f} {unit}"

    failed = "-" if r.failed is None else str(r.failed)
    rows = [["requests ok / failed", f"{'-' if r.completed is None else r.completed} / {failed}"],
            ["duration", num(r.duration_s, "s")],
            ["TTFT p50 / p99", ms("ttft", "p50", "p99")],
            ["TPOT p50 / p99", ms("tpot", "p50", "p99")],
            ["ITL p99", ms("itl", "p99")],
            ["output throughput", num(r.output_throughput, "tok/s")],
            ["request throughput", num(r.request_throughput, "req/s")],
            ["goodput", num(r.goodput, "req/s")]]
    if r.partial and r.note:
        rows.append(["partial", r.note])
    return rows


def _line(text: str) -> None:
    console.out.print(text, markup=False, highlight=False)
