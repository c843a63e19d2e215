"""Simulated `vllm bench serve` (vLLM 0.32.0's vllm/benchmarks/serve.py, read in its source), stdlib only.

What it runs like the real one: the `random` dataset against an OpenAI completions endpoint (`--backend openai`
or `vllm`), streamed, with `--num-prompts`, `--request-rate` (Poisson or gamma arrivals, `--burstiness`),
`--max-concurrency`, `--seed`, `--ignore-eos` (forced for `random`, as in vLLM), warm-ups, the ready check,
`--goodput`, `--percentile-metrics`, `--metric-percentiles`, and `--save-result` / `--save-detailed` /
`--append-result` / `--result-dir` / `--result-filename` / `--metadata` / `--label`. It prints the same lines and
summary block and saves the same JSON keys, with vLLM's definitions (TPOT = (latency - TTFT) / (tokens - 1),
numpy's mean/std/median/linear percentiles). The API key comes from `$OPENAI_API_KEY` as a Bearer header.
There is no tokenizer on a lab host: a prompt of N input tokens is N words, which the simulator's server counts
as N + 1 (its BOS), the count real `vllm bench serve` with the lab tokenizer also reports; the token counts in
the result come from the server's `usage`, as in the real client. SIGINT mid-run ends it as it ends the real one
(asyncio.run's KeyboardInterrupt): a traceback, no summary, no file, exit by SIGINT. Other datasets, backends,
ramp-up, LoRA, probes, profiling and plots are refused with a message naming the flag (exit 2).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .vllm_args import TOP_USAGE_032, dashes
from .vllm_bench_flags import BENCH_FLAGS_032, BenchFlag
from .vllm_bench_stats import Output, calculate, print_metric, print_summary

WORDS = ("ba", "ce", "di", "fo", "gu", "ha", "je", "ki", "lo", "mu", "na", "pe", "ri", "so", "tu", "ve")
REQUEST_TIMEOUT_S = 6 * 60 * 60  # aiohttp's total timeout in the real client
# What this simulation runs; any other value of these flags is refused (exit 2) rather than half-simulated.
SIMULATED = {"dataset_name": ("random",), "backend": ("openai", "vllm")}
UNSUPPORTED_TRUE = ("profile", "plot_timeline", "plot_dataset_stats", "use_beam_search")


class BenchError(Exception):
    """A ValueError of the real command: it ends with a traceback and exit status 1."""


def _converter(flag: BenchFlag) -> Any:
    return {"int": int, "float": float, "json": json.loads}.get(flag.type, str)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm bench serve", usage="vllm bench serve [options]")
    for flag in BENCH_FLAGS_032:
        default = float("inf") if flag.default == "inf" else flag.default
        kw: dict[str, Any] = {"dest": flag.dest, "default": default}
        if flag.dest == "request_id_prefix":
            kw["default"] = f"bench-{uuid.uuid4().hex[:8]}-"  # serve.py: a fresh prefix per run
        if flag.kind == "flag":
            kw["action"] = "store_true"
        elif flag.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _converter(flag)
            if flag.kind != "value":
                kw["nargs"] = flag.kind
            if flag.choices:
                kw["choices"] = flag.choices
        p.add_argument(*flag.options, **kw)
    return p


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """Real 0.32's flags; an unknown one is reported by the top-level `vllm` parser, as the real CLI does."""
    args, unknown = build_parser().parse_known_args(dashes(argv))
    if unknown:
        sys.stderr.write(f"{TOP_USAGE_032}vllm: error: unrecognized arguments: {' '.join(unknown)}\n")
        raise SystemExit(2)
    for dest, allowed in SIMULATED.items():
        if getattr(args, dest) not in allowed:
            _not_simulated(f"--{dest.replace('_', '-')} {getattr(args, dest)}")
    for dest in ("dataset_path", "ramp_up_strategy", "lora_modules"):
        if getattr(args, dest) is not None:
            _not_simulated(f"--{dest.replace('_', '-')}")
    for dest in UNSUPPORTED_TRUE:
        if getattr(args, dest):
            _not_simulated(f"--{dest.replace('_', '-')}")
    if args.probe_request_rate > 0:
        _not_simulated("--probe-request-rate")
    if not args.endpoint.endswith("completions") or args.endpoint.endswith("chat/completions"):
        _not_simulated(f"--endpoint {args.endpoint}")
    return args


def _not_simulated(what: str) -> None:
    sys.stderr.write(f"vllm bench serve (lab simulator): {what} is not simulated; the simulator runs the "
                     "random dataset against /v1/completions (--backend openai or vllm)\n")
    raise SystemExit(2)


@dataclass(frozen=True)
class Sample:
    prompt: str
    prompt_len: int
    output_len: int
    request_id: str


def sample_random(args: argparse.Namespace, rng: random.Random) -> list[Sample]:
    """RandomDataset.sample's lengths (datasets/utils.py get_sampling_params, no special tokens to add)."""
    ratio = args.random_range_ratio
    parsed = json.loads(ratio) if isinstance(ratio, str) and ratio.strip().startswith("{") else float(ratio)
    in_rr, out_rr = ((float(parsed["input"]), float(parsed["output"])) if isinstance(parsed, dict)
                     else (parsed, parsed))
    if not (0.0 <= in_rr < 1.0):
        raise BenchError("input_range_ratio must be in [0, 1).")
    if not (0.0 <= out_rr < 1.0):
        raise BenchError("output_range_ratio must be in [0, 1).")
    in_len, out_len = max(0, args.random_input_len), args.random_output_len
    in_low, in_high = math.floor(in_len * (1 - in_rr)), math.ceil(in_len * (1 + in_rr))
    out_low, out_high = max(1, math.floor(out_len * (1 - out_rr))), max(1, math.ceil(out_len * (1 + out_rr)))
    if args.random_prefix_len + in_low < 1:
        raise BenchError("--random-input-len is too small: the minimum possible total input tokens (prefix + "
                         f"sampled) is {args.random_prefix_len + in_low}. Increase --random-input-len and/or "
                         "--random-prefix-len, or decrease the input range ratio.")
    _log("utils.py:88", f"Sampling input_len from [{in_low}, {in_high}] and output_len from [{out_low}, {out_high}]")
    prefix = [rng.choice(WORDS) for _ in range(args.random_prefix_len)]
    samples = []
    for i in range(args.num_prompts):
        n_in, n_out, offset = rng.randint(in_low, in_high), rng.randint(out_low, out_high), rng.randrange(10**6)
        words = prefix + [WORDS[(offset + i + k) % len(WORDS)] for k in range(n_in)]
        samples.append(Sample(" ".join(words), len(words), n_out, f"{args.request_id_prefix}{i}"))
    return samples


def _log(site: str, message: str) -> None:
    """vLLM's logger line as the real command prints it (one process, no engine prefix)."""
    stamp = datetime.now().strftime("%m-%d %H:%M:%S")
    print(f"(MainProcess pid={os.getpid()}) INFO {stamp} [{site}] {message}", flush=True)


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    base_path: str
    api_path: str
    headers: dict[str, str]
    model: str  # the payload's "model": the served name if given, else --model
    extra_body: dict[str, Any]
    ignore_eos: bool

    def connect(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        return http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)


def _headers(extra: dict[str, str] | None) -> dict[str, str]:
    """_get_headers: the key from $OPENAI_API_KEY as a Bearer header; --header values override."""
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return {**headers, **(extra or {})}


def send(target: Target, sample: Sample) -> Output:
    """async_request_openai_completions: one streamed completion, timed at each chunk with choices."""
    payload = {"model": target.model, "prompt": sample.prompt, "repetition_penalty": 1.0,
               "max_tokens": sample.output_len, "logprobs": None, "stream": True,
               "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(target.extra_body)
    out = Output(prompt_len=sample.prompt_len)
    headers = {**target.headers, "x-request-id": sample.request_id}
    st = last = out.start_time = time.perf_counter()
    text: list[str] = []
    conn = target.connect()
    try:
        conn.request("POST", target.api_path, body=json.dumps(payload), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = resp.reason or ""
            resp.read()
            return out
        first = False
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line.removeprefix("data: "))
            if choices := data.get("choices"):
                now = time.perf_counter()
                if not first:
                    first, out.ttft = True, now - st
                else:
                    out.itl.append(now - last)
                last = now
                text.append(choices[0].get("text") or "")
            elif usage := data.get("usage"):
                out.output_tokens = usage.get("completion_tokens") or 0
                if usage.get("prompt_tokens") is not None:
                    out.prompt_len = usage["prompt_tokens"]
        out.success = first
        if not first:
            out.error = "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"
        out.generated_text = "".join(text)
        out.latency = last - st
    except Exception:  # the real client records any failure as the request's error text
        out.success = False
        out.error = traceback.format_exc()
    finally:
        conn.close()
    return out


def arrival_delays(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """get_request's schedule: gamma (Poisson at burstiness 1) gaps, rescaled so the last is n / rate."""
    if burstiness <= 0:
        raise BenchError(f"A positive burstiness factor is expected, but given {burstiness}.")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise BenchError(f"Obtained non-positive request rate {rate}.")
    gaps = [1.0 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
            for _ in range(n)]
    cumulative = [sum(gaps[: i + 1]) for i in range(n)]
    factor = (n / rate) / cumulative[-1] if cumulative and cumulative[-1] else 1.0
    return [c * factor for c in cumulative]


def run_load(target: Target, samples: list[Sample], delays: list[float], max_concurrency: int | None) -> list[Output]:
    """Every request on its own daemon thread, started at its arrival time, gated by --max-concurrency; the
    main thread only waits (so SIGINT's KeyboardInterrupt lands there and ends the process, as in vLLM)."""
    gate = threading.Semaphore(max_concurrency) if max_concurrency else None
    outputs: list[Output | None] = [None] * len(samples)

    def one(i: int, arrival: float) -> None:
        if gate is not None:
            with gate:
                out = send(target, samples[i])
        else:
            out = send(target, samples[i])
        out.client_queue_time = out.start_time - arrival
        outputs[i] = out

    threads = []
    start = time.time()
    for i, delay in enumerate(delays):
        wait = start + delay - time.time()
        if wait > 0:
            time.sleep(wait)
        thread = threading.Thread(target=one, args=(i, time.perf_counter()), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return [o if o is not None else Output(error="no result") for o in outputs]


def _first_model(base: str, headers: dict[str, str]) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/v1/models", headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"Failed to fetch models from server at {base}/v1/models. Check that:\n1. The "
                               f"server is running\n2. The server URL is correct\nError: {resp.status}, "
                               f"message='{resp.reason}'")
        data = json.loads(body)["data"]
    except (OSError, ValueError, KeyError) as err:
        raise RuntimeError(f"Failed to fetch models from server at {base}/v1/models. Check that:\n1. The server "
                           f"is running\n2. The server URL is correct\nError: {err}") from err
    finally:
        conn.close()
    if not data:
        raise BenchError(f"No models found on the server at {base}. Make sure the server is running and has models "
                         "loaded.")
    return str(data[0]["id"]), str(data[0]["root"])


def _ready_check(target: Target, sample: Sample, timeout_s: int) -> None:
    """wait_for_endpoint: the first prompt, every 5 s until it succeeds or the time is up."""
    print(f"Waiting for endpoint to become up in {timeout_s} seconds", flush=True)
    deadline = time.perf_counter() + timeout_s
    out = Output()
    while time.perf_counter() < deadline:
        out = send(target, sample)
        if out.success:
            print("Initial test run completed.", flush=True)
            return
        time.sleep(max(0.0, min(5.0, deadline - time.perf_counter())))
    raise BenchError("Initial test run failed - Please make sure benchmark arguments are correctly specified. "
                     f"Error: {out.error}")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    goodput: dict[str, float] = {}
    for pair in pairs or []:
        try:
            slo_name, slo_value = pair.split(":")
            goodput[slo_name] = float(slo_value)
        except ValueError as err:
            raise BenchError('Invalid format found for service level objectives. Specify service level objectives '
                             'for goodput as "KEY:VALUE" pairs, where the key is a metric name, and the value is a '
                             "number in milliseconds.") from err
    for name, value in goodput.items():
        if name not in ("ttft", "tpot", "e2el"):
            raise BenchError(f"Invalid metric name found, {name}: {value}. The service level objective name "
                             "should be one of ['ttft', 'tpot', 'e2el']. ")
        if value < 0:
            raise BenchError(f"Invalid value found, {name}: {value}. The service level objective value should be "
                             "non-negative.")
    return goodput


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise BenchError(f"Invalid {what} format. Please use KEY=VALUE format.")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _target(args: argparse.Namespace, model: str, headers: dict[str, str], extra: dict[str, Any]) -> Target:
    base = args.base_url if args.base_url is not None else (
        f"http://[{args.host}]:{args.port}" if ":" in args.host else f"http://{args.host}:{args.port}")
    parts = urllib.parse.urlsplit(base)
    return Target(parts.scheme, parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80),
                  base, parts.path.rstrip("/") + args.endpoint, headers, model, extra, args.ignore_eos)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """serve.py main_async, for what the simulator runs."""
    shown = argparse.Namespace(subparser="bench", bench_type="serve", **vars(args))
    if shown.header is not None:
        shown.header = "***"
    print(shown, flush=True)
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise BenchError("--max-concurrency must be greater than 0")
    rng = random.Random(args.seed)
    base = args.base_url if args.base_url is not None else _target(args, "", {}, {}).base_path
    headers = _headers(_pairs(args.header, "header") if args.header else None)
    if args.model is None:
        print("Model not specified, fetching first model from server...", flush=True)
        model_name, model_id = _first_model(base, headers)
        print(f"First model name: {model_name}, first model id: {model_id}", flush=True)
    else:
        model_name, model_id = args.served_model_name, args.model
    tokenizer_id = None if args.skip_tokenizer_init else (args.tokenizer or model_id)
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
    args.ignore_eos = True  # random dataset on an OpenAI-compatible backend: generation runs to the length
    if args.self_timed is not None:
        raise BenchError("--self-timed/--no-self-timed is only supported with --dataset-name=timed_trace")
    samples = sample_random(args, rng)
    print("WARNING: /tokenize unavailable, skipping alignment.", flush=True)  # the simulator has no /tokenize
    goodput = parse_goodput(args.goodput)
    sampling = {k: v for k in ("top_p", "top_k", "min_p", "temperature", "frequency_penalty", "presence_penalty",
                               "repetition_penalty") if (v := getattr(args, k)) is not None}
    if "temperature" not in sampling:
        print("WARNING: vllm bench serve no longer sets temperature==0 (greedy) in requests by default. The default "
              "will be determined on the server side and can be model/API specific. For the old behavior, include "
              "--temperature=0.", flush=True)
    target = _target(args, model_name or model_id, headers, {**sampling, **(args.extra_body or {})})
    result = benchmark(args, target, samples, goodput, rng, tokenizer=tokenizer_id is not None)
    return save(args, result, model_id, tokenizer_id)


def benchmark(args: argparse.Namespace, target: Target, samples: list[Sample], goodput: dict[str, float],
              rng: random.Random, tokenizer: bool) -> dict[str, Any]:
    print("Starting initial single prompt test run...", flush=True)
    if args.ready_check_timeout_sec > 0:
        _ready_check(target, samples[0], args.ready_check_timeout_sec)
    else:
        print("Skipping endpoint ready check.", flush=True)
    if args.num_warmups > 0:
        print(f"Warming up with {args.num_warmups} requests...", flush=True)
        run_load(target, [samples[0]] * args.num_warmups, [0.0] * args.num_warmups, args.max_concurrency)
        print("Warmup run completed.", flush=True)
    print("Starting main benchmark run...", flush=True)
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}", flush=True)
    print(f"Burstiness factor: {args.burstiness} ({distribution})", flush=True)
    print(f"Maximum request concurrency: {args.max_concurrency}", flush=True)
    delays = arrival_delays(len(samples), args.request_rate, args.burstiness, rng)
    started = time.perf_counter()
    outputs = run_load(target, samples, delays, args.max_concurrency)
    duration = time.perf_counter() - started
    metrics = calculate(outputs, duration, goodput)
    print_summary(metrics, args.max_concurrency, args.request_rate, duration, bool(goodput), tokenizer)
    result: dict[str, Any] = {
        "duration": duration, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": metrics.output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs], "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs], "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests, "rtfx": 0.0,
    }
    selected = (args.percentile_metrics or "ttft,tpot,itl").split(",")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    ok = [o for o in outputs if o.success]
    series: dict[str, tuple[str, str, list[float]]] = {
        "ttft": ("TTFT", "Time to First Token", metrics.ttfts),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)", metrics.tpots),
        "itl": ("ITL", "Inter-token Latency", metrics.itls),
        "e2el": ("E2EL", "End-to-end Latency", metrics.e2els),
    }
    if args.max_concurrency is not None:
        series["client_queue_time"] = ("Client Queue Time", "Client-side Queueing",
                                       [o.client_queue_time for o in ok])
        if not math.isinf(args.request_rate):
            series["e2el_including_client_queue"] = ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency",
                                                     [o.latency + o.client_queue_time for o in ok])
    order = ["ttft", "tpot", "itl"] if tokenizer else []
    for name in [*order, "e2el", "client_queue_time", "e2el_including_client_queue"]:
        if name in series and name in selected:
            label, header, values = series[name]
            result.update(print_metric(name, label, header, values, percentiles))
    print("=" * 50, flush=True)
    return result


def save(args: argparse.Namespace, result: dict[str, Any], model_id: str, tokenizer_id: str | None) -> dict[str, Any]:
    """main_async's result JSON: the setup keys, --metadata, the traffic keys, then the benchmark's."""
    current_dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {"date": current_dt, "endpoint_type": args.backend, "backend": args.backend,
                           "label": args.label, "model_id": model_id, "tokenizer_id": tokenizer_id,
                           "num_prompts": args.num_prompts}
    out.update(_pairs(args.metadata, "metadata"))
    out["request_rate"] = args.request_rate if args.request_rate < float("inf") else "inf"
    out["burstiness"] = args.burstiness
    out["max_concurrency"] = args.max_concurrency
    out.update(result)
    if not args.save_detailed:
        for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
            out.pop(key, None)
    if args.save_result or args.append_result:
        concurrency = "" if args.max_concurrency is None else f"-concurrency{args.max_concurrency}"
        name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps{concurrency}"
                                        f"-{model_id.split('/')[-1]}-{current_dt}.json")
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            name = os.path.join(args.result_dir, name)
        with open(name, "a+" if args.append_result else "w", encoding="utf-8") as handle:
            if args.append_result and handle.tell() != 0:
                handle.write("\n")
            json.dump(out, handle)
    return out


def main(argv: list[str]) -> int:
    """`vllm bench serve ARGS`: 0 when it ran, 1 on vLLM's ValueError/RuntimeError, 2 on a bad command line."""
    args = parse_bench_args(argv)
    try:
        run(args)
    except (BenchError, RuntimeError) as err:
        kind = "ValueError" if isinstance(err, BenchError) else "RuntimeError"
        sys.stderr.write(f"Traceback (most recent call last):\n  File \"vllm/benchmarks/serve.py\", in main_async\n"
                         f"{kind}: {err}\n")
        return 1
    return 0

