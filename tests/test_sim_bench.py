"""The simulator's latency model and its `vllm bench serve`, against a simulated server on 127.0.0.1.

The saved result is compared with a real `vllm bench serve` 0.32.0 result (tests/fixtures/bench/, made by running
the real command against this simulator); every process runs in its own session, is killed in a finalizer, and
every wait has a deadline.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_sim_vllm import Lab, Server, free_port

from ernie_deploy.lab.sim.vllm_bench_stats import percentile
from ernie_deploy.lab.sim.vllm_latency import DECODE_PER_TOKEN, JITTER, LatencyModel

REPO = Path(__file__).resolve().parents[1]
REAL_RESULT = REPO / "tests/fixtures/bench/vllm-0.32.0-random.json"


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    lab.version("0.32.0")
    yield lab
    lab.kill_all()


def bench(lab: Lab, server_port: int, *flags: str, name: str = "run.json", timeout: float = 60,
          **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    out_dir = lab.root / "bench"
    argv = [sys.executable, "-m", "ernie_deploy.lab.sim.vllm_sim", "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{server_port}", "--endpoint", "/v1/completions", "--model", "ernie",
            "--tokenizer", lab.model, "--dataset-name", "random", "--seed", "7", "--disable-tqdm",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", name, *flags]
    done = subprocess.run(argv, env=lab.env(**env), capture_output=True, text=True, timeout=timeout, check=False,
                          start_new_session=True)
    path = out_dir / name
    return done, json.loads(path.read_text()) if path.exists() else None


def metric(server: Server, name: str) -> float:
    _, raw = server.request("GET", "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.startswith(name) and line[len(name)] in "{, ")


# -- the model -----------------------------------------------------------------------------------------------


def test_tpot_shrinks_with_tp_less_than_linearly() -> None:
    tpots = [LatencyModel(tp=tp).tpot(1, "k", 5) for tp in (1, 2, 4, 8)]
    assert tpots == sorted(tpots, reverse=True) and len(set(tpots)) == 4
    assert 1.2 < tpots[0] / tpots[1] < 2.0  # a doubling buys less than 2x


def test_ttft_grows_with_concurrency_and_input_and_tpot_with_batch() -> None:
    model = LatencyModel()
    assert [model.ttft(128, r, "k") for r in (1, 2, 8, 32)] == sorted(model.ttft(128, r, "k") for r in (1, 2, 8, 32))
    assert model.ttft(128, 8, "k") > model.ttft(128, 1, "k")
    assert model.ttft(2048, 1, "k") > model.ttft(512, 1, "k") > model.ttft(16, 1, "k")
    assert model.tpot(16, "k", 3) > model.tpot(1, "k", 3)


def test_model_is_deterministic_with_small_jitter_and_scales() -> None:
    model = LatencyModel(tp=2)
    assert model.ttft(100, 3, "abc") == LatencyModel(tp=2).ttft(100, 3, "abc")
    steps = [model.tpot(1, "abc", i) for i in range(1, 200)]
    nominal = DECODE_PER_TOKEN / model.speedup()
    assert all(abs(s / nominal - 1) <= JITTER + 1e-9 for s in steps) and len(set(steps)) > 100
    assert LatencyModel(tp=2, scale=5).tpot(1, "abc", 1) == pytest.approx(5 * steps[0])
    assert LatencyModel(token_seconds=0.05).tpot(64, "abc", 1) == 0.05  # the old knob stays exact


@pytest.mark.parametrize("kwargs", [{"scale": 0}, {"scale": -1}, {"scale": float("nan")}, {"tp": 0},
                                    {"token_seconds": -0.1}])
def test_bad_model_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        LatencyModel(**kwargs)  # type: ignore[arg-type]


def test_percentile_is_numpy_linear() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert percentile([], 99) == 0.0


# -- bench serve against the simulated server ---------------------------------------------------------------


def test_bench_result_matches_real_keys_model_and_metrics(lab: Lab) -> None:
    server = lab.start("--served-model-name", "ernie")
    server.wait_ready()
    real = json.loads(REAL_RESULT.read_text())
    done, result = bench(lab, server.port, "--random-input-len", "64", "--random-output-len", "32",
                         "--num-prompts", "16", "--max-concurrency", "4", "--percentile-metrics",
                         "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--goodput", "ttft:2000",
                         "tpot:500")
    assert done.returncode == 0, done.stderr
    assert result is not None and list(result) == list(real)  # same keys, same order as the real file
    assert (result["completed"], result["failed"], result["max_concurrency"]) == (16, 0, 4)
    assert result["total_output_tokens"] == 16 * 32 and result["total_input_tokens"] == 16 * 65  # server's BOS
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # The client's numbers follow the model: at most 4 requests run at once.
    model = LatencyModel()
    low, high = model.ttft(65, 1, "k") / (1 + JITTER), model.ttft(65, 4, "k") / (1 - JITTER)
    assert low <= result["median_ttft_ms"] / 1000 <= high + 0.015
    assert DECODE_PER_TOKEN * (1 - JITTER) <= result["median_tpot_ms"] / 1000 <= model.tpot(4, "k", 1) * 1.3
    # ... and so does the server's /metrics.
    assert metric(server, "vllm:generation_tokens_total") == result["total_output_tokens"]
    assert metric(server, 'vllm:request_success_total{engine="0",finished_reason="length"') == 16
    server_ttft = metric(server, "vllm:time_to_first_token_seconds_sum") / 16
    assert abs(server_ttft * 1000 - result["mean_ttft_ms"]) < 10
    itl_sum, itl_n = (metric(server, f"vllm:inter_token_latency_seconds_{k}") for k in ("sum", "count"))
    assert itl_n == 16 * 31 and abs(itl_sum / itl_n * 1000 - result["mean_itl_ms"]) < 1.5
    # The printed block is the real one's.
    assert "============ Serving Benchmark Result ============" in done.stdout
    assert re.search(r"^Successful requests:\s{21}16\s*$", done.stdout, re.M)
    assert re.search(r"^P99 TPOT \(ms\):\s+\d+\.\d\d\s*$", done.stdout, re.M)


def test_tp_and_latency_scale_change_tpot(lab: Lab) -> None:
    slow_port = free_port()
    lab.faults({"ports": {str(slow_port): {"latency_scale": 4}}})
    name = ("--served-model-name", "ernie")
    servers = {"tp1": lab.start(*name, CUDA_VISIBLE_DEVICES="0"),
               "tp2": lab.start(*name, "-tp", "2", CUDA_VISIBLE_DEVICES="1,2"),
               "slow": lab.start(*name, port=slow_port, CUDA_VISIBLE_DEVICES="3")}
    tpot: dict[str, float] = {}
    for key, server in servers.items():
        server.wait_ready()
        done, result = bench(lab, server.port, "--random-input-len", "16", "--random-output-len", "24",
                             "--num-prompts", "4", "--max-concurrency", "1", name=f"{key}.json")
        assert done.returncode == 0 and result is not None, done.stderr
        assert result["completed"] == 4, done.stdout
        tpot[key] = result["mean_tpot_ms"]
    assert tpot["tp2"] < tpot["tp1"] < tpot["slow"]
    assert tpot["slow"] / tpot["tp1"] == pytest.approx(4, rel=0.2)


def test_sigint_stops_a_run_like_real_vllm(lab: Lab) -> None:
    lab.faults({"latency_scale": 20})
    server = lab.start("--served-model-name", "ernie")
    server.wait_ready()
    out = lab.root / "bench"
    argv = [sys.executable, "-m", "ernie_deploy.lab.sim.vllm_sim", "bench", "serve", "--base-url",
            f"http://127.0.0.1:{server.port}", "--model", "ernie", "--served-model-name", "ernie",
            "--num-prompts", "500", "--random-input-len", "32", "--random-output-len", "256", "--max-concurrency",
            "2", "--save-result", "--result-dir", str(out), "--result-filename", "cut.json"]
    proc = subprocess.Popen(argv, env=lab.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        time.sleep(2)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - started < 5
    # asyncio.run's KeyboardInterrupt, uncaught: a traceback, nothing summarised or saved, death by SIGINT.
    assert proc.returncode == -signal.SIGINT
    assert stderr.rstrip().endswith("KeyboardInterrupt") and "Serving Benchmark Result" not in stdout
    assert not (out / "cut.json").exists()


def test_a_down_server_fails_every_request(lab: Lab) -> None:
    done, result = bench(lab, free_port(), "--served-model-name", "ernie", "--num-prompts", "3",
                         "--random-input-len", "8", "--random-output-len", "4")
    assert done.returncode == 0 and result is not None
    assert (result["completed"], result["failed"]) == (0, 3)
    assert "All requests failed" in done.stderr and "Error 0: Traceback" in done.stdout


def test_flags_the_release_lacks_and_bad_values(lab: Lab) -> None:
    port = free_port()
    unknown, _ = bench(lab, port, "--max-duration", "5")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("usage: vllm [-h] [-v]\n")
    assert unknown.stderr.endswith("vllm: error: unrecognized arguments: --max-duration 5\n")
    other, _ = bench(lab, port, "--dataset-name", "sharegpt")
    assert other.returncode == 2 and "--dataset-name sharegpt is not simulated" in other.stderr
    slo, _ = bench(lab, port, "--goodput", "latency:5")
    assert slo.returncode == 1 and "ValueError: Invalid metric name found, latency: 5.0." in slo.stderr
    conc, _ = bench(lab, port, "--max-concurrency", "0")
    assert conc.returncode == 1 and "ValueError: --max-concurrency must be greater than 0" in conc.stderr
    typed, _ = bench(lab, port, "--num-prompts", "many")
    assert typed.returncode == 2 and "argument --num-prompts: invalid int value: 'many'" in typed.stderr


def test_bad_latency_scale_stops_serve_before_it_binds(lab: Lab) -> None:
    lab.faults({"latency_scale": "fast"})
    out = lab.serve_fail()
    assert out.returncode == 1
    assert f"{lab.root}/etc/ernie-lab/faults.json: latency_scale must be a number > 0, got 'fast'" in out.stderr
