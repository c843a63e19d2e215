"""The numbers and the printed block of the simulated `vllm bench serve`: 0.32.0's calculate_metrics and its
summary lines (vllm/benchmarks/serve.py), with numpy's mean, population std, median and linear-interpolation
percentiles written out in the standard library.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field

MS = 1000.0


@dataclass
class Output:
    """One request's outcome, RequestFuncOutput's fields."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0  # np.mean(values or 0)


def std(values: list[float]) -> float:
    return statistics.pstdev(values) if values else 0.0  # np.std: the population form


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def percentile(values: list[float], p: float) -> float:
    """np.percentile's default (linear) method."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Metrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]
    ttfts: list[float]
    tpots: list[float]
    itls: list[float]
    e2els: list[float]


def calculate(outputs: list[Output], duration: float, goodput: dict[str, float]) -> Metrics:
    """calculate_metrics for a generation backend with a tokenizer (the output counts come from `usage`)."""
    lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_input = 0
    for out in outputs:
        if not out.success:
            lens.append(0)
            continue
        n = out.output_tokens or 1
        lens.append(n)
        total_input += out.prompt_len
        tpot = (out.latency - out.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += out.itl
        ttfts.append(out.ttft)
        e2els.append(out.latency)
    good = 0
    if goodput:
        checks = [(values, goodput[name] / MS) for name, values in (("ttft", ttfts), ("tpot", all_tpots),
                                                                     ("e2el", e2els)) if name in goodput]
        good = sum(all(limit >= vals[i] for vals, limit in checks) for i in range(len(ttfts)))
    completed = len(ttfts)
    if completed == 0:
        sys.stderr.write("UserWarning: All requests failed. This is likely due to a misconfiguration on the "
                         "benchmark arguments.\n")
    failed = [o for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, out in enumerate(failed[:10]):
            print(f"Error {i}: {out.error}")
    peak_tokens, peak_running = _peaks([o for o in outputs if o.success])
    total_output = sum(lens)
    return Metrics(completed, len(failed), total_input, total_output, completed / duration, good / duration,
                   total_output / duration, (total_input + total_output) / duration, peak_tokens, peak_running,
                   lens, ttfts, tpots, itls, e2els)


def _peaks(ok: list[Output]) -> tuple[float, int]:
    """The busiest second's output tokens and the most requests active in one second (whole-second buckets)."""
    if not ok:
        return 0.0, 0
    print("tip: install termplotlib and gnuplot to plot the metrics")
    t0 = min(o.start_time for o in ok)
    seconds = math.ceil(max(o.start_time + o.latency for o in ok) - t0) + 1
    tokens = [0.0] * seconds
    running = [0] * seconds
    for out in ok:
        stamp = out.start_time + out.ttft
        times = [stamp]
        for gap in out.itl:
            stamp += gap
            times.append(stamp)
        for t in times:
            bucket = int(t - t0)
            if 0 <= bucket < seconds:
                tokens[bucket] += 1
        for second in range(int(out.start_time - t0), int(out.start_time + out.latency - t0) + 1):
            running[second] += 1
    return max(tokens), max(running)


def _line(label: str, value: object, fmt: str = "") -> None:
    print(("{:<40} {:<10" + fmt + "}").format(label, value))


def print_summary(m: Metrics, max_concurrency: int | None, request_rate: float, duration: float,
                  goodput: bool, tokenizer: bool) -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    _line("Successful requests:", m.completed)
    _line("Failed requests:", m.failed)
    if max_concurrency is not None:
        _line("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        _line("Request rate configured (RPS):", request_rate, ".2f")
    _line("Benchmark duration (s):", duration, ".2f")
    _line("Total input tokens:", m.total_input)
    if tokenizer:
        _line("Total generated tokens:", m.total_output)
    _line("Request throughput (req/s):", m.request_throughput, ".2f")
    if goodput:
        _line("Request goodput (req/s):", m.request_goodput, ".2f")
    if tokenizer:
        _line("Output token throughput (tok/s):", m.output_throughput, ".2f")
        _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    _line("Peak concurrent requests:", m.max_concurrent_requests, ".2f")
    if tokenizer:
        _line("Total token throughput (tok/s):", m.total_token_throughput, ".2f")


def print_metric(name: str, label: str, header: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    """process_one_metric: the block's lines and the result keys mean/median/std/pNN of `name`, in ms."""
    print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
    keys = {f"mean_{name}_ms": mean(values) * MS, f"median_{name}_ms": median(values) * MS,
            f"std_{name}_ms": std(values) * MS}
    _line(f"Mean {label} (ms):", keys[f"mean_{name}_ms"], ".2f")
    _line(f"Median {label} (ms):", keys[f"median_{name}_ms"], ".2f")
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        keys[f"p{word}_{name}_ms"] = percentile(values, p) * MS
        _line(f"P{word} {label} (ms):", keys[f"p{word}_{name}_ms"], ".2f")
    return keys
