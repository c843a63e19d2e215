"""`ernie-deploy bench`: the workload and SLO settings, vllm bench serve's command line, the reading of its real
result file, the SLO judgement, the host program (run here against a stand-in instance), and the command against
a scripted host: a down instance named, a bench past its bound stopped with partial numbers, exit codes, JSON."""

from __future__ import annotations

import getpass
import http.server
import itertools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import BENCH_RESULT, FakeHost, connector

from ernie_deploy.cli.main import main
from ernie_deploy.errors import DeployError, ExitCode, InventoryError
from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.bench import BenchRunner, outcome
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.orchestration.results import Status, exit_code
from ernie_deploy.planning.bench import (
    BenchResult,
    BenchSpec,
    Slo,
    Workload,
    bench_argv,
    bench_error,
    bench_spec,
    judge,
    parse_result,
    partial_result,
)
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.remote.bench import GRACE, Bench, BenchRun, bench_command, parse
from ernie_deploy.remote.command import Op

FIXTURE = Path(__file__).parent / "fixtures/bench/vllm-0.32.0-random.json"
KEY = "sk-bench-secret-0123"


def _argv(spec: BenchSpec | None = None, **kw: str) -> tuple[str, ...]:
    args = {"vllm": "/opt/vllm/0.32.0/bin/vllm", "base_url": "http://127.0.0.1:8000", "served": "ernie",
            "tokenizer": "/models/ERNIE-4.5-0.3B-PT", "result_dir": "/tmp/r", "result_name": "result.json", **kw}
    return bench_argv(spec or BenchSpec(), **args)


# -- the command line ------------------------------------------------------------------------------------------

def test_argv_is_vllm_bench_serve_with_the_workload_and_every_percentile() -> None:
    argv = _argv(BenchSpec(Workload(input_len=256, output_len=64, num_prompts=10, request_rate=2.5, max_concurrency=4,
                                    seed=7)))
    assert argv[:3] == ("/opt/vllm/0.32.0/bin/vllm", "bench", "serve")
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--backend"] == "openai" and pairs["--dataset-name"] == "random"
    assert (pairs["--random-input-len"], pairs["--random-output-len"], pairs["--num-prompts"]) == ("256", "64", "10")
    assert (pairs["--request-rate"], pairs["--max-concurrency"], pairs["--seed"]) == ("2.5", "4", "7")
    assert pairs["--percentile-metrics"] == "ttft,tpot,itl,e2el" and pairs["--metric-percentiles"] == "50,90,99"
    # The served name is what each request asks for; the model directory only makes the prompts.
    assert {"--model=ernie", "--tokenizer=/models/ERNIE-4.5-0.3B-PT", "--base-url=http://127.0.0.1:8000",
            "--endpoint=/v1/completions", "--result-dir=/tmp/r", "--result-filename=result.json", "--save-result",
            "--disable-tqdm"} <= set(argv)
    assert "--goodput" not in argv  # no latency SLO: nothing to count goodput against


def test_argv_defaults_send_everything_at_once_bounded_by_concurrency_and_goodput_follows_the_slos() -> None:
    argv = _argv(BenchSpec(slo=Slo(ttft_p99_ms=3500, tpot_p99_ms=100.5, itl_p99_ms=200)))
    pairs = dict(itertools.pairwise(argv))
    assert (pairs["--request-rate"], pairs["--max-concurrency"], pairs["--num-prompts"]) == ("inf", "8", "50")
    start = argv.index("--goodput")
    assert argv[start + 1:start + 3] == ("ttft:3500", "tpot:100.5")  # vLLM's goodput knows ttft, tpot, e2el only
    assert "--max-concurrency" not in _argv(BenchSpec(Workload(max_concurrency=None)))


def test_argv_keeps_odd_values_one_argument_each_and_never_readable_as_flags() -> None:
    argv = _argv(served="-my model; rm -rf /", tokenizer="/models/with space/$HOME")
    assert "--model=-my model; rm -rf /" in argv and "--tokenizer=/models/with space/$HOME" in argv


def test_the_api_key_travels_on_stdin_only() -> None:
    argv = _argv()
    intent = Bench("ernie-vllm-0.service", "http://127.0.0.1:8000", "ernie", argv, "/tmp/r", "vllm", 300.0)
    cmd = bench_command(intent, KEY)
    assert KEY not in cmd.script and KEY not in " ".join(argv) and KEY not in cmd.label
    spec = json.loads(cmd.stdin)
    assert spec["api_key"] == KEY and spec["argv"] == list(argv) and spec["user"] == "vllm"
    assert cmd.op is Op.BENCH and not cmd.check and cmd.timeout > 300.0 + GRACE
    assert "/models/ERNIE" not in cmd.script  # the script is the program only: every value comes on stdin


# -- the result and the judgement ------------------------------------------------------------------------------

def test_a_real_result_file_is_read() -> None:
    """tests/fixtures/bench/README.md says how the file was made (real vllm bench serve 0.32.0)."""
    result, raw = parse_result(FIXTURE.read_text(), "h")
    assert (result.completed, result.failed, result.output_tokens) == (20, 0, 640)
    assert result.duration_s == pytest.approx(1.586, abs=1e-3)
    assert result.output_throughput == pytest.approx(403.52, abs=0.01)
    assert result.request_throughput == pytest.approx(12.61, abs=0.01) and result.goodput == result.request_throughput
    assert result.metric("ttft", "p99") == pytest.approx(84.83, abs=0.01)
    assert result.metric("tpot", "p50") == pytest.approx(8.09, abs=0.01)
    assert result.metric("itl", "p99") == pytest.approx(10.70, abs=0.01)
    assert result.metric("e2el", "p90") == pytest.approx(347.73, abs=0.01)
    assert raw["model_id"] == "ernie-4.5" and raw["tokenizer_id"] and not result.partial


def test_a_result_that_is_not_json_is_an_error_naming_the_host() -> None:
    with pytest.raises(DeployError, match="not JSON") as err:
        parse_result("Traceback (most recent call last):", "gpu-a10-01")
    assert err.value.where == "gpu-a10-01"
    with pytest.raises(DeployError, match="not an object"):
        parse_result("[1, 2]", "h")


def test_each_slo_passes_or_fails_with_its_numbers() -> None:
    result, _ = parse_result(FIXTURE.read_text(), "h")
    verdicts = {v.slo: v for v in judge(result, Slo(ttft_p99_ms=50, tpot_p99_ms=100, itl_p99_ms=11,
                                                    min_output_throughput=500, min_goodput=10))}
    assert not verdicts["ttft_p99_ms"].ok and verdicts["ttft_p99_ms"].summary == "TTFT p99 84.8 ms > 50 ms"
    assert verdicts["tpot_p99_ms"].ok and verdicts["itl_p99_ms"].ok
    assert not verdicts["min_output_throughput"].ok
    assert verdicts["min_output_throughput"].summary == "output throughput 403.5 tok/s < 500 tok/s"
    assert verdicts["min_goodput"].ok and verdicts["requests"].ok and verdicts["requests"].measured == 0
    assert verdicts["ttft_p99_ms"].variable == "vllm_slo_ttft_p99_ms"
    check = verdicts["ttft_p99_ms"].check("ernie-vllm-0")
    assert check.status == "fail" and check.instance == "ernie-vllm-0" and "vllm_slo_ttft_p99_ms" in (check.fix or "")
    assert judge(result, Slo()) == []  # no SLOs: nothing judged


def test_a_missing_metric_fails_with_the_reason_never_passes() -> None:
    raw = json.loads(FIXTURE.read_text())
    del raw["p99_ttft_ms"], raw["request_goodput"]
    raw["failed"] = 3
    result, _ = parse_result(json.dumps(raw), "h")
    verdicts = {v.slo: v for v in judge(result, Slo(ttft_p99_ms=1e9, min_goodput=0.001))}
    assert not verdicts["ttft_p99_ms"].ok and verdicts["ttft_p99_ms"].measured is None
    assert "not measured" in verdicts["ttft_p99_ms"].summary
    assert not verdicts["min_goodput"].ok
    assert not verdicts["requests"].ok and verdicts["requests"].summary == "3 of 23 requests failed"
    assert all(not v.ok for v in judge(None, Slo(ttft_p99_ms=1e9), "not measured: the bench failed"))


def test_a_stopped_bench_is_measured_from_vllms_counters() -> None:
    def page(done: float, aborted: float, tokens: float) -> str:
        return ("# HELP vllm:request_success_total Count of successfully processed requests.\n"
                f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="ernie"}} {done}\n'
                f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="ernie"}} {aborted}\n'
                f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="other"}} 999\n'
                f'vllm:generation_tokens_total{{engine="0",model_name="ernie"}} {tokens}\n')
    result = partial_result(page(10, 0, 100), page(19, 4, 4708), "ernie", 25.0)
    assert result is not None and result.partial and result.completed == 9 and result.output_tokens == 4608
    assert result.output_throughput == pytest.approx(4608 / 25) and result.failed is None
    verdicts = judge(result, Slo(ttft_p99_ms=1e9, min_output_throughput=1))
    assert [v.ok for v in verdicts] == [False, True, False]  # no latency, no failed count: not met
    assert "stopped before vllm bench finished" in verdicts[0].summary
    assert partial_result("", page(19, 4, 4708), "ernie", 25.0) is None  # no counters: nothing measured


def test_the_error_that_ended_a_bench_is_found_under_its_shutdown_noise() -> None:
    tail = ["ValueError: Initial test run failed - Please make sure benchmark arguments are correctly specified. "
            "Error: Bad Request", "nanobind: leaked 4 instances!", ' - leaked instance 0x7 of type "x"',
            "See https://nanobind.readthedocs.io/en/latest/refleaks.html"]
    assert bench_error(tail).startswith("ValueError: Initial test run failed")
    assert bench_error(["starting", "nanobind: leaked 1 types!"]) == "starting"
    assert bench_error([]) == "it printed nothing"


# -- the settings ----------------------------------------------------------------------------------------------

def test_the_spec_takes_the_inventory_then_the_runs_overrides() -> None:
    assert bench_spec({}, "h") == BenchSpec()
    spec = bench_spec({"bench_num_prompts": 20, "bench_timeout": 60, "slo_ttft_p99_ms": 3500, "max_model_len": 4096},
                      "h", {"bench_num_prompts": 5, "bench_request_rate": 2})
    assert spec.workload.num_prompts == 5 and spec.workload.timeout == 60.0 and spec.workload.request_rate == 2.0
    assert spec.slo == Slo(ttft_p99_ms=3500.0)


@pytest.mark.parametrize(("name", "value", "fix"), [
    ("bench_num_prompts", 0, "set vllm_bench_num_prompts to the requests one bench sends"),
    ("bench_input_len", -5, "set vllm_bench_input_len to the prompt length in tokens"),
    ("bench_timeout", 0, "set vllm_bench_timeout to the seconds one bench may run"),
    ("bench_request_rate", -1.0, "set vllm_bench_request_rate to requests per second"),
    ("slo_ttft_p99_ms", 0, "set vllm_slo_ttft_p99_ms to milliseconds"),
    ("slo_min_output_throughput", -3, "set vllm_slo_min_output_throughput to output tokens per second"),
])
def test_a_bad_value_names_the_host_the_variable_and_the_fix(name: str, value: float, fix: str) -> None:
    with pytest.raises(InventoryError) as err:
        bench_spec({name: value}, "gpu-a10-01")
    assert err.value.where == "gpu-a10-01" and f"vllm_{name} must be" in err.value.message
    assert (err.value.hint or "").startswith(fix)


def test_goodput_without_a_latency_limit_is_refused() -> None:
    with pytest.raises(InventoryError, match="vllm_slo_min_goodput") as err:
        bench_spec({"slo_min_goodput": 1}, "h")
    assert "vllm_slo_ttft_p99_ms" in (err.value.hint or "")


def _inventory(tmp_path: Path, **host_vars: object) -> Path:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1"}, "hosts": {"a": host_vars}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def _hosts(path: Path) -> list[Host]:
    return list(load_inventory(path).select(None))


def test_a_misspelt_bench_variable_is_an_error_with_the_closest_name(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, vllm_bench_num_promts=5, vllm_slo_ttft_p99=100)
    (plan,) = plan_hosts(list(load_inventory(inv).select(None)), PlanContext.load())
    found = {f.message: f.fix for f in plan.findings}
    assert found["unknown variable vllm_bench_num_promts"] == "did you mean vllm_bench_num_prompts?"
    assert found["unknown variable vllm_slo_ttft_p99"] == "did you mean vllm_slo_ttft_p99_ms?"


def test_plan_refuses_a_bad_bench_value_and_explain_shows_the_set_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (plan,) = plan_hosts(list(load_inventory(_inventory(tmp_path, vllm_bench_num_prompts=0)).select(None)),
                         PlanContext.load())
    assert not plan.ok and any("vllm_bench_num_prompts must be at least 1" in f.message for f in plan.findings)
    inv = _inventory(tmp_path, vllm_bench_num_prompts=20, vllm_slo_ttft_p99_ms=3500)
    assert main(["explain", "-i", str(inv), "a", "--json"]) == ExitCode.OK
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["bench_num_prompts"]["value"] == 20
    assert settings["bench_num_prompts"]["source"] == "inventory variable"
    assert settings["slo_ttft_p99_ms"]["value"] == 3500


# -- the host program, run here against a stand-in instance ------------------------------------------------------

class _Instance(http.server.BaseHTTPRequestHandler):
    health = 200
    done = 0.0

    def do_GET(self) -> None:  # http.server's name
        if self.path == "/health":
            body = b""
            self.send_response(self.health)
        else:
            type(self).done += 5
            body = (f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {self.done}\n'
                    f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {self.done * 10}\n'
                    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n').encode()
            self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def instance() -> Iterator[str]:
    _Instance.health, _Instance.done = 200, 0.0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Instance)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# A stand-in `vllm`: writes a result naming whether OPENAI_API_KEY reached it, or sleeps (the time bound's case).
FAKE_VLLM = """#!{python}
import json, os, sys, time
args = dict(a.split("=", 1) for a in sys.argv if a.startswith("--result-"))
if os.environ.get("FAKE_SLEEP"):
    print("Starting main benchmark run...", flush=True)
    time.sleep(60)
with open(os.path.join(args["--result-dir"], args["--result-filename"]), "w") as f:
    json.dump({{"completed": 3, "failed": 0, "key": os.environ.get("OPENAI_API_KEY"), "argv": sys.argv[1:]}}, f)
"""


def _host_run(tmp_path: Path, base: str, timeout: float, sigint_ignored: bool = False,
              **env: str) -> tuple[BenchRun, str]:
    vllm = tmp_path / "vllm"
    vllm.write_text(FAKE_VLLM.format(python=sys.executable))
    vllm.chmod(vllm.stat().st_mode | stat.S_IXUSR)
    result_dir = str(tmp_path / "run")
    argv = _argv(vllm=str(vllm), base_url=base, served="m", result_dir=result_dir)
    cmd = bench_command(Bench("u.service", base, "m", argv, result_dir, getpass.getuser(), timeout), KEY)
    # sigint_ignored: started the way a script's background job or nohup starts it (the child inherits SIG_IGN).
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    out = subprocess.run(["sh", "-c", cmd.script], input=cmd.stdin, capture_output=True, timeout=60, check=True,
                         env={**os.environ, **env}, preexec_fn=ignore)
    assert not os.path.exists(result_dir)  # its own directory is removed, nothing else is
    return parse(out.stdout.decode()), out.stdout.decode()


def test_the_host_program_benches_with_the_key_in_the_environment_and_prints_the_result(
        tmp_path: Path, instance: str) -> None:
    seen, text = _host_run(tmp_path, instance, 30)
    assert seen.health == 200 and seen.exit_code == 0 and not seen.timed_out and seen.error is None
    saved = json.loads(seen.result or "")
    assert saved["key"] == KEY and "--model=m" in saved["argv"]
    assert "vllm:request_success_total" in seen.before and "num_requests_running" not in seen.after
    assert text.count(KEY) == 1  # only in the result the stand-in wrote


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "started-with-sigint-ignored"])
def test_the_host_program_stops_a_bench_at_its_bound_and_keeps_the_counters(
        tmp_path: Path, instance: str, sigint_ignored: bool) -> None:
    seen, _ = _host_run(tmp_path, instance, 1.0, sigint_ignored, FAKE_SLEEP="1")
    assert seen.timed_out and seen.exit_code not in (0, None) and seen.result is None
    assert seen.tail[0] == "Starting main benchmark run..." and seen.tail[-1] == "KeyboardInterrupt"  # SIGINT
    assert 1.0 <= seen.seconds < 1.0 + GRACE
    result = partial_result(seen.before, seen.after, "m", seen.seconds)
    assert result is not None and result.completed == 5 and result.output_tokens == 50


def test_the_host_program_does_not_bench_a_down_instance(tmp_path: Path, instance: str) -> None:
    _Instance.health = 503
    seen, text = _host_run(tmp_path, instance, 30)
    assert seen.health == 503 and seen.exit_code is None and '"event": "exit"' not in text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    seen, _ = _host_run(tmp_path, closed, 30)
    assert seen.health is None and seen.health_error and seen.reached


# -- the command against a scripted host -----------------------------------------------------------------------

def _deployed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **host_vars: object) -> tuple[FakeHost, Path]:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    inv = _inventory(tmp_path, vllm_api_key=KEY, **host_vars)
    fake = FakeHost()
    opts = Options(health_timeout=5.0, stable=0.0, poll=0.01,
                   cycle=CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01))
    (r,) = Runner(PlanContext.load(), connector({"a": fake}), opts).run(_hosts(inv))
    assert r.status is Status.CHANGED, r.message
    return fake, inv


def _bench(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake: FakeHost, inv: Path,
           tmp_path: Path, *args: str) -> tuple[int, Any]:
    monkeypatch.setattr("ernie_deploy.cli.bench.connector", lambda args: connector({"a": fake}))
    code = main(["bench", "-i", str(inv), "--json", "--save", str(tmp_path / "saved"), *args])
    return code, json.loads(capsys.readouterr().out)


def _instances(doc: Any) -> list[Any]:
    return list(doc["hosts"]["a"]["instances"])


def test_bench_measures_every_instance_saves_the_raw_result_and_exits_0_when_slos_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_slo_ttft_p99_ms=3500, vllm_slo_min_output_throughput=100)
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path, "--num-prompts", "20")
    assert code == ExitCode.OK and doc["schema"] == "ernie-deploy/bench/v1" and doc["exit_code"] == 0
    (inst,) = _instances(doc)
    assert inst["status"] == "ok" and inst["ok"] and inst["workload"]["num_prompts"] == 20
    assert [v["slo"] for v in inst["verdicts"]] == ["ttft_p99_ms", "min_output_throughput", "requests"]
    assert inst["raw"] == json.loads(BENCH_RESULT) and inst["result"]["completed"] == 20
    saved = Path(str(inst["saved"]))
    assert saved.parent == tmp_path / "saved" / "a" and json.loads(saved.read_text()) == inst["raw"]
    (sent,) = [c for c in fake.received if c.op is Op.BENCH]
    assert KEY not in sent.script and KEY not in " ".join(sent.intent.argv)  # type: ignore[attr-defined]
    assert json.loads(sent.stdin)["api_key"] == KEY
    assert "--num-prompts" in sent.intent.argv and "20" in sent.intent.argv  # type: ignore[attr-defined]


def test_the_text_output_is_a_table_per_instance_with_each_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_slo_ttft_p99_ms=50)
    monkeypatch.setattr("ernie_deploy.cli.bench.connector", lambda args: connector({"a": fake}))
    assert main(["bench", "-i", str(inv), "--save", str(tmp_path / "s")]) == ExitCode.FAILED
    out = capsys.readouterr().out
    assert "a ernie-vllm-0 (" in out and "SLO-FAILED" in out and "TTFT p50 / p99" in out and "84.8" in out
    assert "SLO FAIL: TTFT p99 84.8 ms > 50 ms" in out and "SLO pass: 0 of 20 requests failed" in out
    assert "raw result:" in out


def test_a_failed_slo_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_slo_tpot_p99_ms=5)
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path)
    (inst,) = _instances(doc)
    assert code == ExitCode.FAILED and inst["status"] == "slo-failed"
    assert doc["hosts"]["a"]["status"] == "failed"


def test_a_down_instance_is_named_and_not_benched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    fake.active.clear()
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path)
    (inst,) = _instances(doc)
    assert code == ExitCode.FAILED and inst["status"] == "down" and inst["result"] is None
    assert inst["message"] == ("ernie-vllm-0 is down: http://127.0.0.1:8000/health did not answer ([Errno 111] "
                               "Connection refused); not benched")


def test_a_bench_past_its_bound_is_stopped_and_reported_partial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_slo_min_output_throughput=1)
    fake.bench_ends = {"ernie-vllm-0.service": "timeout"}
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path, "--timeout", "30")
    (inst,) = _instances(doc)
    assert code == ExitCode.FAILED and inst["status"] == "timed-out" and inst["raw"] is None
    assert inst["result"]["partial"] and inst["result"]["completed"] == 9
    assert inst["message"].startswith("stopped at its time bound (30s) before its 50 requests finished: 9 request(s)")
    assert [v["ok"] for v in inst["verdicts"]] == [True, False]  # throughput met (lower bound); failures unknown


def test_a_bench_that_fails_says_vllms_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    fake.bench_ends = {"ernie-vllm-0.service": "fail"}
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path)
    (inst,) = _instances(doc)
    assert code == ExitCode.FAILED and inst["status"] == "failed"
    assert inst["message"].startswith("vllm bench serve exited 1 without a result: ValueError: Initial test run failed")
    fake.bench_ends = {"ernie-vllm-0.service": json.dumps({**json.loads(BENCH_RESULT), "completed": 0, "failed": 20})}
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path)
    assert code == ExitCode.FAILED and _instances(doc)[0]["message"].startswith("no request succeeded (20 failed)")


def test_an_unreachable_host_exits_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    fake.unreachable = True
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path)
    assert code == ExitCode.UNREACHABLE and doc["hosts"]["a"]["status"] == "unreachable"


def test_a_workload_longer_than_the_context_is_refused_before_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_max_model_len=1024)
    code, doc = _bench(monkeypatch, capsys, fake, inv, tmp_path, "--input-len", "1000", "--output-len", "100")
    (inst,) = _instances(doc)
    assert code == ExitCode.FAILED and inst["status"] == "error" and "above its max_model_len 1024" in inst["message"]
    assert not [c for c in fake.received if c.op is Op.BENCH]


@pytest.mark.parametrize("option", [["--num-prompts", "0"], ["--timeout", "-1"], ["--request-rate", "inf"],
                                    ["--seed", "-1"]])
def test_bad_overrides_are_usage_errors(option: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["bench", "-i", str(_inventory(tmp_path)), *option])
    assert err.value.code == ExitCode.INPUT and option[1] in capsys.readouterr().err


def test_the_runner_stops_between_instances_when_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal during a host's first bench: its next instance is not started, the host says so."""
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_instances=2, vllm_tensor_parallel_size=1)
    fleet = Fleet(connector({"a": fake}), FleetOptions())
    fleet.progress = lambda host, what: fleet.abort.set() if "vllm bench serve" in what else None
    runner = BenchRunner(PlanContext.load(), fleet, save_dir=tmp_path / "s")
    (r,) = runner.run(_hosts(inv))
    assert len(runner.reports["a"]) == 1 and r.status is Status.FAILED and r.message == "interrupted"
    assert exit_code([r]) == ExitCode.FAILED


def test_outcome_of_a_host_without_python3_is_an_error() -> None:
    from ernie_deploy.planning.plantypes import InstancePlan
    inst = InstancePlan(0, "ernie-vllm-0", 8000, "0.0.0.0", (0,), "ernie", 1, 1, None, 0.9, (), None)
    made = outcome(parse('@@ernie-deploy:bench {"event": "error", "error": "python3 not found on the host"}\n'),
                   BenchSpec(), inst, "h")
    assert made.status == "error" and made.message == "the bench did not run: python3 not found on the host"
    assert BenchResult(1, 0, 1.0, 1.0, 1.0, None, 1).metric("ttft", "p99") is None
