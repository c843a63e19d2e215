"""`ernie-deploy bench`: the workload and SLOs of a load test with vLLM's own `vllm bench serve`, its command
line, the reading of its result, and the SLO judgement. Pure: the bench command, a playbook task and a rollout's
gate build the same spec, argv and verdicts from here.

The workload and SLOs are inventory variables (settings.BENCH_TYPES, validated by the plan and shown by
`explain`), overridable per run. Facts of vLLM 0.32.0 `vllm/benchmarks/serve.py` this relies on:
* `--model` is the name sent in each request's "model" field (with no `--served-model-name`, model_name is None
  and the request carries model_id); `--tokenizer` is the tokenizer the prompts are made with, here the
  instance's model directory, so `--model` can stay the served name that /tokenize and routing expect.
* `--request-rate inf` sends every request at once; `--max-concurrency` bounds those in flight. Both may be set:
  arrivals at the rate, at most that many at a time (serve.py's own help).
* The saved result has `completed`, `failed`, `duration` (s), `request_throughput` (req/s), `output_throughput`
  (tok/s), `request_goodput` (req/s; None without `--goodput`) and per metric of `--percentile-metrics`
  `mean_/median_/std_{m}_ms` plus `p{P}_{m}_ms` per `--metric-percentiles` value (P printed without ".0").
* `--goodput ttft:MS tpot:MS` counts a request as good when each of its own values is within the limit
  (DistServe's goodput); the p99 SLOs give those limits.
* On SIGINT it saves nothing (no handler: asyncio.run ends with KeyboardInterrupt), so a bench stopped at its
  time bound is measured from vLLM's /metrics counters instead (`partial_result`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ernie_deploy.checks.metrics import parse_sample
from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import DeployError, InventoryError
from ernie_deploy.planning.hostpaths import local_url
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.settings import BENCH_TYPES, check_type, raise_all

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = ("50", "90", "99")
ENDPOINT = "/v1/completions"
# Counters of vLLM's /metrics (V1 engine, `vllm/v1/metrics/loggers.py`) a partial result is read from; the
# Prometheus client appends `_total` to a counter's samples.
SUCCESS = "vllm:request_success_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
# finished_reason values of request_success that are not a finished request (the bench's own requests are
# aborted when it stops).
NOT_FINISHED = ("abort", "error")


@dataclass(frozen=True)
class Workload:
    """What one bench sends: `num_prompts` random prompts of `input_len` tokens, each generating `output_len`;
    `request_rate` None sends them all at once (vLLM's `inf`), `max_concurrency` None leaves them unbounded."""

    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 50
    request_rate: float | None = None
    max_concurrency: int | None = 8
    timeout: float = 300.0  # seconds the bench may run on the host before it is stopped (SIGINT)
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"dataset": "random", "input_len": self.input_len, "output_len": self.output_len,
                "num_prompts": self.num_prompts, "request_rate": self.request_rate,
                "max_concurrency": self.max_concurrency, "timeout_s": self.timeout, "seed": self.seed}


@dataclass(frozen=True)
class Slo:
    """Service-level objectives; None: not judged."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    min_output_throughput: float | None = None  # output tokens per second
    min_goodput: float | None = None  # requests per second within the TTFT/TPOT limits

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def to_json(self) -> dict[str, float | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class BenchSpec:
    workload: Workload = field(default_factory=Workload)
    slo: Slo = field(default_factory=Slo)


# Setting name (inventory variable without `vllm_`) → (which part, field).
_FIELDS: dict[str, tuple[str, str]] = {
    **{f"bench_{f.name}": ("workload", f.name) for f in fields(Workload)},
    **{f"slo_{f.name}": ("slo", f.name) for f in fields(Slo)},
}
# Fields held as floats whatever number the inventory wrote (YAML's 300 is an int).
_FLOATS = {"request_rate", "timeout", *(f.name for f in fields(Slo))}


def bench_spec(settings: Mapping[str, Any], where: str, overrides: Mapping[str, Any] | None = None) -> BenchSpec:
    """The spec from a host's bench settings (names without `vllm_`, as `HostPlan.settings` has them; other
    settings are ignored) and a run's `overrides` (same names, e.g. `bench --num-prompts`), both validated.
    Raises every problem at once, each naming `where` (the host), the variable and the fix."""
    problems: list[InventoryError] = []
    values: dict[str, Any] = {}
    for source in (settings, overrides or {}):
        for name, value in source.items():
            if name not in BENCH_TYPES or value is None:
                continue
            try:
                values[name] = check_type(name, value, where, BENCH_TYPES)
            except InventoryError as exc:
                problems.append(exc)
    raise_all(problems, where)
    parts: dict[str, dict[str, Any]] = {"workload": {}, "slo": {}}
    for name, value in values.items():
        part, attr = _FIELDS[name]
        parts[part][attr] = float(value) if attr in _FLOATS else value
    spec = BenchSpec(Workload(**parts["workload"]), Slo(**parts["slo"]))
    if spec.slo.min_goodput is not None and spec.slo.ttft_p99_ms is None and spec.slo.tpot_p99_ms is None:
        raise InventoryError("vllm_slo_min_goodput is set, but goodput counts the requests within the TTFT and TPOT "
                             "limits and neither is set", where=where,
                             hint="set vllm_slo_ttft_p99_ms and/or vllm_slo_tpot_p99_ms, or remove "
                                  "vllm_slo_min_goodput (vllm_slo_min_output_throughput needs no limits)")
    return spec



def spec_from_plan(plan: HostPlan, overrides: Mapping[str, Any] | None = None) -> BenchSpec:
    """The spec of a planned host: its inventory's bench settings, then `overrides`."""
    return bench_spec({name: s.value for name, s in plan.settings.items()}, plan.name, overrides)


def fits(spec: BenchSpec, plan: HostPlan, inst: InstancePlan) -> None:
    """Raise when the instance would refuse every request of the workload: vLLM answers 400 to a prompt plus
    output longer than max_model_len, so the bench would measure only errors."""
    w = spec.workload
    limit = inst.max_model_len
    if limit is not None and w.input_len + w.output_len > limit:
        raise InventoryError(f"{inst.unit}: vllm_bench_input_len {w.input_len} + vllm_bench_output_len "
                             f"{w.output_len} = {w.input_len + w.output_len} tokens, above its max_model_len "
                             f"{limit}: vLLM would refuse every request", where=plan.name,
                             hint=f"lower vllm_bench_input_len / vllm_bench_output_len to {limit} tokens together")


def goodput_args(slo: Slo) -> tuple[str, ...]:
    """vLLM's `--goodput` pairs from the latency SLOs (empty when neither is set)."""
    pairs = [("ttft", slo.ttft_p99_ms), ("tpot", slo.tpot_p99_ms)]
    return tuple(f"{name}:{value:g}" for name, value in pairs if value is not None)


def bench_argv(spec: BenchSpec, *, vllm: str, base_url: str, served: str, tokenizer: str, result_dir: str,
               result_name: str) -> tuple[str, ...]:
    """`vllm bench serve`'s command line (an argument list, run without a shell). The API key is never in it
    (vLLM's openai backend reads OPENAI_API_KEY). String values go as `--flag=value`, so a value starting with
    `-` cannot be read as a flag."""
    w = spec.workload
    argv = [vllm, "bench", "serve", "--backend", "openai", f"--base-url={base_url}", f"--endpoint={ENDPOINT}",
            f"--model={served}", f"--tokenizer={tokenizer}", "--dataset-name", "random",
            "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
            "--num-prompts", str(w.num_prompts),
            "--request-rate", "inf" if w.request_rate is None else f"{w.request_rate:g}"]
    if w.max_concurrency is not None:
        argv += ["--max-concurrency", str(w.max_concurrency)]
    argv += ["--percentile-metrics", ",".join(PERCENTILE_METRICS), "--metric-percentiles", ",".join(PERCENTILES)]
    goodput = goodput_args(spec.slo)
    if goodput:
        argv += ["--goodput", *goodput]
    argv += ["--seed", str(w.seed), "--save-result", f"--result-dir={result_dir}", f"--result-filename={result_name}",
             "--disable-tqdm"]
    return tuple(argv)


def instance_argv(spec: BenchSpec, plan: HostPlan, inst: InstancePlan, result_dir: str,
                  result_name: str) -> tuple[str, ...]:
    """bench_argv for one planned instance: the host's vLLM (HostPlan.bin), the instance as its host reaches it,
    its served name, and the model directory as tokenizer."""
    return bench_argv(spec, vllm=plan.bin, base_url=local_url(inst.host, inst.port), served=inst.served_model_name,
                      tokenizer=plan.model_path, result_dir=result_dir, result_name=result_name)


@dataclass(frozen=True)
class BenchResult:
    """What one bench measured. `partial`: stopped at its time bound and read from vLLM's counters (no
    latencies); `latency_ms[metric][stat]` with stat "mean", "median" or "p50"/"p90"/"p99"."""

    completed: int | None
    failed: int | None
    duration_s: float | None
    request_throughput: float | None  # req/s
    output_throughput: float | None  # tok/s
    goodput: float | None  # req/s within the limits of --goodput
    output_tokens: int | None
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    partial: bool = False
    note: str | None = None  # how a partial result was measured

    def metric(self, name: str, stat: str) -> float | None:
        return self.latency_ms.get(name, {}).get(stat)

    def to_json(self) -> dict[str, Any]:
        return {"completed": self.completed, "failed": self.failed, "duration_s": self.duration_s,
                "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
                "goodput": self.goodput, "output_tokens": self.output_tokens, "latency_ms": self.latency_ms,
                "partial": self.partial, "note": self.note}


def _number(raw: Mapping[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _count(raw: Mapping[str, Any], key: str) -> int | None:
    value = _number(raw, key)
    return None if value is None else int(value)


def parse_result(text: str, where: str) -> tuple[BenchResult, dict[str, Any]]:
    """vllm bench serve's saved result file, read: the measured values and the raw document. A metric the file
    lacks is None (judged as not measured, never as met). Raises when it is not a JSON object."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise DeployError(f"vllm bench serve's result is not JSON ({exc})", where=where,
                          hint="run it by hand on the host to see what it printed") from None
    if not isinstance(raw, dict):
        raise DeployError(f"vllm bench serve's result is a JSON {type(raw).__name__}, not an object", where=where)
    latency: dict[str, dict[str, float]] = {}
    for metric in PERCENTILE_METRICS:
        stats = {stat: _number(raw, f"{stat}_{metric}_ms") for stat in ("mean", "median")}
        stats |= {f"p{p}": _number(raw, f"p{p}_{metric}_ms") for p in PERCENTILES}
        found = {k: v for k, v in stats.items() if v is not None}
        if found:
            latency[metric] = found
    result = BenchResult(completed=_count(raw, "completed"), failed=_count(raw, "failed"),
                         duration_s=_number(raw, "duration"), request_throughput=_number(raw, "request_throughput"),
                         output_throughput=_number(raw, "output_throughput"), goodput=_number(raw, "request_goodput"),
                         output_tokens=_count(raw, "total_output_tokens"), latency_ms=latency)
    return result, raw


def _counters(text: str, served: str) -> tuple[float, float] | None:
    """Finished requests and generated tokens of the served model, summed over engines; None when the page lacks
    either counter."""
    finished = tokens = None
    for line in text.splitlines():
        sample = parse_sample(line)
        if sample is None or sample.labels.get("model_name", served) != served:
            continue
        if sample.name == SUCCESS and sample.labels.get("finished_reason") not in NOT_FINISHED:
            finished = (finished or 0.0) + sample.value
        elif sample.name == GENERATION_TOKENS:
            tokens = (tokens or 0.0) + sample.value
    return None if finished is None or tokens is None else (finished, tokens)


def partial_result(before: str, after: str, served: str, seconds: float) -> BenchResult | None:
    """What a bench stopped at its time bound had done, from the instance's /metrics read before it started and
    after it stopped: finished requests and generated tokens, per second of the whole run (vllm bench's own
    start-up included, so the rates are lower bounds; other traffic to the instance is counted too). None when
    the counters could not be read."""
    start, end = _counters(before, served), _counters(after, served)
    if start is None or end is None or seconds <= 0:
        return None
    finished, tokens = max(0, round(end[0] - start[0])), max(0, round(end[1] - start[1]))
    return BenchResult(completed=finished, failed=None, duration_s=seconds, request_throughput=finished / seconds,
                       output_throughput=tokens / seconds, goodput=None, output_tokens=tokens, partial=True,
                       note="stopped at its time bound: vLLM's request_success and generation_tokens counters "
                            "over the whole run (lower bounds; no latencies)")


@dataclass(frozen=True)
class Verdict:
    """One SLO judged: `measured` None means not measured, which fails."""

    slo: str  # the Slo field, or "requests" (every request must succeed)
    variable: str | None  # the inventory variable that set it
    limit: float
    measured: float | None
    ok: bool
    summary: str

    def check(self, instance: str | None) -> CheckResult:
        """The verdict as a check, for verify's and a rollout's gates."""
        fix = None if self.ok else (f"find the cause (load, TP, max_num_seqs) or adjust {self.variable}"
                                    if self.variable else "ernie-deploy logs shows why requests failed")
        return CheckResult(f"slo:{self.slo}", "pass" if self.ok else "fail", self.summary, fix=fix, instance=instance)

    def to_json(self) -> dict[str, Any]:
        return {"slo": self.slo, "variable": self.variable, "limit": self.limit, "measured": self.measured,
                "ok": self.ok, "summary": self.summary}


# SLO field → (what it reads, the label shown, unit, upper limit (True) or lower bound (False)).
_JUDGED: dict[str, tuple[tuple[str, str] | str, str, str, bool]] = {
    "ttft_p99_ms": (("ttft", "p99"), "TTFT p99", "ms", True),
    "tpot_p99_ms": (("tpot", "p99"), "TPOT p99", "ms", True),
    "itl_p99_ms": (("itl", "p99"), "ITL p99", "ms", True),
    "min_output_throughput": ("output_throughput", "output throughput", "tok/s", False),
    "min_goodput": ("goodput", "goodput", "req/s", False),
}


def judge(result: BenchResult | None, slo: Slo, why_missing: str | None = None) -> list[Verdict]:
    """Each set SLO against the result, plus, when any is set, that no request failed. A metric the result does
    not have (no result, a partial one, a file without it) fails with `why_missing` (or "not measured"): an SLO
    is met only by a measurement."""
    if not slo.any:
        return []
    missing = why_missing or ("stopped before vllm bench finished" if result is not None and result.partial
                              else "not measured")
    out = []
    for name, (source, label, unit, upper) in _JUDGED.items():
        limit = getattr(slo, name)
        if limit is None:
            continue
        measured = None if result is None else (
            result.metric(*source) if isinstance(source, tuple) else getattr(result, source))
        variable = f"vllm_slo_{name}"
        if measured is None:
            out.append(Verdict(name, variable, limit, None, False, f"{label}: {missing} (limit {limit:g} {unit})"))
            continue
        ok = measured <= limit if upper else measured >= limit
        sign = ("≤" if ok else ">") if upper else ("≥" if ok else "<")
        summary = f"{label} {measured:.1f} {unit} {sign} {limit:g} {unit}"
        out.append(Verdict(name, variable, limit, measured, ok, summary))
    if result is None or result.partial or result.failed is None:
        out.append(Verdict("requests", None, 0, None, False, f"failed requests: {missing}"))
    else:
        total = result.failed + (result.completed or 0)
        out.append(Verdict("requests", None, 0, result.failed, result.failed == 0,
                           f"{result.failed} of {total} requests failed"))
    return out


# Lines vllm bench prints that never say why it failed: Python's shutdown noise from native extensions.
_NOISE = ("nanobind:", " - leaked ", " - ... skipped", "See https://nanobind")


def bench_error(tail: Sequence[str]) -> str:
    """Why a bench ended without a result, from the last lines it printed: the last error line (a traceback's
    last line, vLLM's "Initial test run failed" ...), else the last line that is not shutdown noise."""
    lines = [line.strip() for line in tail if line.strip() and not line.startswith(_NOISE)]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "failed" in line:
            return line
    return lines[-1] if lines else "it printed nothing"
