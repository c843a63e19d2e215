"""`status` and the progress check against a scripted host: a stalled, stuck or unreadable serving instance is a
problem named with its readings and fix (exit 2); an idle one costs a single reading; one that does not serve is
not read. Also the host's reader program itself, run here against a local HTTP server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.checks.progress import Thresholds, judge
from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.orchestration.progress import PROGRAM, ReadProgress, parse, progress_command, read_progress
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.status import StatusReader
from ernie_deploy.orchestration.transport import target_for
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.remote.command import Command

UNITS = ("ernie-vllm-0", "ernie-vllm-1")


def page(running: float, waiting: float, generated: float) -> str:
    labels = 'engine="0",model_name="ernie-4.5"'
    return (f"vllm:num_requests_running{{{labels}}} {running}\nvllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"vllm:generation_tokens_total{{{labels}}} {generated}\nvllm:kv_cache_usage_perc{{{labels}}} 0.5\n")


def _inventory(tmp_path: Path, **host_vars: Any) -> Path:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_instances": 2, "vllm_tensor_parallel_size": 1},
                    "hosts": {"a": host_vars}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def _hosts(path: Path) -> list[Host]:
    return list(load_inventory(path).select(None))


@pytest.fixture
def deployed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeHost, Path]:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    path, fake = _inventory(tmp_path), FakeHost()
    opts = Options(health_timeout=5.0, stable=0.0, poll=0.01,
                   cycle=CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01))
    (r,) = Runner(PlanContext.load(), connector({"a": fake}), opts).run(_hosts(path))
    assert r.status is Status.CHANGED, r.message
    fake.received.clear()
    return fake, path


def _progress_commands(fake: FakeHost) -> list[Command]:
    return [c for c in fake.received if isinstance(c.intent, ReadProgress)]


def _status_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake: FakeHost, path: Path,
                *args: str) -> tuple[int, str]:
    monkeypatch.setattr("ernie_deploy.cli.status.connector", lambda args: connector({"a": fake}))
    capsys.readouterr()
    code = main(["status", "-i", str(path), *args])
    return code, capsys.readouterr().out


def test_a_stalled_instance_is_named_with_its_readings_and_fix_and_exits_2(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = deployed
    fake.progress_pages = {"ernie-vllm-1": [page(3, 0, 120), page(3, 0, 120)]}
    code, out = _status_cli(monkeypatch, capsys, fake, path)
    assert code == ExitCode.FAILED
    assert "ernie-vllm-0.service: active/running" in out and "progress idle" in out
    assert "progress stalled" in out
    assert ("drift [progress] ernie-vllm-1.service: stalled: running 3→3, waiting 0→0, generated 120→120 tokens "
            "over 5 s, KV cache 50%→50%") in out
    assert "fix: restart it: ernie-deploy restart -i INV -l a --instance 1" in out
    # One progress command for the host; only the busy instance was read twice.
    assert len(_progress_commands(fake)) == 1
    assert fake.progress_reads == [("ernie-vllm-0", 1), ("ernie-vllm-1", 1), ("ernie-vllm-1", 2)]


def test_status_json_v4_carries_each_instances_progress(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = deployed
    fake.progress_pages = {"ernie-vllm-0": [page(1, 0, 10), page(1, 0, 60)],
                           "ernie-vllm-1": [page(0, 2, 10), page(0, 5, 10)]}
    code, out = _status_cli(monkeypatch, capsys, fake, path, "--json")
    doc = json.loads(out)
    assert doc["schema"] == "ernie-deploy/status/v5" and code == doc["exit_code"] == ExitCode.FAILED
    host = doc["hosts"]["a"]
    first, second = (i["progress"] for i in host["instances"])
    assert first["state"] == "ok" and first["healthy"] and first["fix"] is None
    assert first["before"]["generated"] == 10 and first["after"]["generated"] == 60
    assert second["state"] == "stuck" and not second["healthy"] and "waiting 2→5" in second["evidence"]
    (drift,) = host["drift"]
    assert drift["kind"] == "progress" and drift["subject"] == "ernie-vllm-1.service"
    assert "ernie-deploy logs -i INV a --instance 1" in drift["fix"]


def test_an_unreadable_metrics_page_is_named_never_healthy(deployed: tuple[FakeHost, Path]) -> None:
    fake, path = deployed
    fake.progress_pages = {"ernie-vllm-0": ["HTTP 404"], "ernie-vllm-1": ["<html>proxy error</html>"]}
    reader = StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions()))
    (r,) = reader.run(_hosts(path))
    assert r.status is Status.FAILED and r.message == "2 instance(s) making no progress"
    assert r.hint is not None and "ernie-deploy logs -i INV a --instance 0" in r.hint
    states = [i["progress"]["state"] for i in reader.reports["a"].instances]
    assert states == ["unreadable", "unreadable"]
    messages = [d.message for d in reader.reports["a"].drift]
    assert "answered HTTP 404" in messages[0] and "/metrics" in messages[0]
    assert "no vLLM metrics on the page" in messages[1]


def test_an_idle_host_costs_a_single_reading_per_instance(deployed: tuple[FakeHost, Path]) -> None:
    fake, path = deployed
    reader = StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions()))
    (r,) = reader.run(_hosts(path))
    assert r.status is not Status.FAILED and not reader.reports["a"].drift
    assert fake.progress_reads == [("ernie-vllm-0", 1), ("ernie-vllm-1", 1)]
    assert [i["progress"]["state"] for i in reader.reports["a"].instances] == ["idle", "idle"]
    (cmd,) = _progress_commands(fake)
    spec = json.loads(cmd.stdin)
    assert [i["id"] for i in spec["instances"]] == list(UNITS) and spec["window"] == 5.0
    assert [i["url"] for i in spec["instances"]] == ["http://127.0.0.1:8000/metrics", "http://127.0.0.1:8001/metrics"]


def test_an_instance_that_does_not_serve_is_not_read(deployed: tuple[FakeHost, Path]) -> None:
    fake, path = deployed
    del fake.active["ernie-vllm-1.service"]
    reader = StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions()))
    reader.run(_hosts(path))
    report = reader.reports["a"]
    assert [d.kind for d in report.drift] == ["down"]  # its own problem, not a second one for /metrics
    assert report.instances[1]["progress"] is None and fake.progress_reads == [("ernie-vllm-0", 1)]
    del fake.active["ernie-vllm-0.service"]
    fake.received.clear()
    StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions())).run(_hosts(path))
    assert not _progress_commands(fake)  # nothing serves: no command at all


def test_a_bad_threshold_fails_the_host_naming_variable_and_fix(deployed: tuple[FakeHost, Path],
                                                                tmp_path: Path) -> None:
    fake, _ = deployed
    path = _inventory(tmp_path, vllm_progress_window=0)
    (r,) = StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions())).run(_hosts(path))
    assert r.status is Status.FAILED and r.message == "the plan has errors; nothing was touched"
    (finding,) = r.findings
    assert "vllm_progress_window must be above 0" in finding.message and not fake.received


# -- read_progress and the host's program -----------------------------------------------------------------------

def _plan(tmp_path: Path, **host_vars: Any) -> HostPlan:
    (plan,) = plan_hosts(list(load_inventory(_inventory(tmp_path, **host_vars)).select(None)), PlanContext.load())
    return plan


def test_python3_missing_or_no_answer_is_unreadable(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    cmd = progress_command(plan, Thresholds())
    assert isinstance(cmd.intent, ReadProgress)
    missing = parse('@@ernie-deploy:progress {"id": "*", "error": "python3 not found on the host"}\n', cmd.intent)
    assert "python3 not found on the host" in str(missing["ernie-vllm-0"][0])
    nothing = parse("", cmd.intent)
    assert "the host printed no reading" in str(nothing["ernie-vllm-1"][0])


def _serve(pages: dict[str, list[str]]) -> tuple[ThreadingHTTPServer, list[tuple[str, str | None]]]:
    """A local HTTP server answering each path's pages in turn (the last one repeats)."""
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("authorization")))
            turns = pages.get(self.path)
            if turns is None:
                self.send_response(404)
                self.end_headers()
                return
            body = turns.pop(0) if len(turns) > 1 else turns[0]
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_the_host_program_reads_busy_instances_twice_and_idle_ones_once(tmp_path: Path) -> None:
    """The program as sent to a host, run here with this python against a real local HTTP server: the idle
    instance is read once, the busy one again after the window, the API key only in the request's header."""
    real = (Path(__file__).parent / "fixtures/real-vllm/0.32.0/http/metrics.txt").read_text()
    server, seen = _serve({"/idle/metrics": [real], "/busy/metrics": [page(2, 0, 100), page(2, 0, 100)]})
    try:
        port = server.server_address[1]
        intent = ReadProgress(("idle", "busy", "gone"), (f"http://127.0.0.1:{port}/idle/metrics",
                                                         f"http://127.0.0.1:{port}/busy/metrics",
                                                         f"http://127.0.0.1:{port}/gone/metrics"), 0.3)
        spec = {"instances": [{"id": u, "url": url} for u, url in zip(intent.units, intent.urls, strict=True)],
                "api_key": "sk-secret", "window": 0.3, "timeout": 5, "limit": 1 << 20,
                "families": ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total",
                             "vllm:kv_cache_usage_perc"],
                "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
                "mark": "@@ernie-deploy:progress "}
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", PROGRAM], input=json.dumps(spec).encode(), capture_output=True,
                             timeout=30, check=True)
        waited = time.monotonic() - t0
    finally:
        server.shutdown()
    # Sent as text: the functions it shares with the controller come as their source, not as imports.
    assert "ernie_deploy" not in PROGRAM and "def has_work(" in PROGRAM and "def fetch(" in PROGRAM
    assert [p for p, _ in seen] == ["/idle/metrics", "/busy/metrics", "/gone/metrics", "/busy/metrics"]
    assert {auth for _, auth in seen} == {"Bearer sk-secret"} and "sk-secret" not in PROGRAM
    assert waited >= 0.3
    readings = parse(out.stdout.decode(), intent)
    assert readings["busy"][0] == readings["busy"][1] and readings["idle"][1] is None
    assert "answered HTTP 404" in str(readings["gone"][0])
    # Only the judged families come back, not the page's histograms.
    assert "bucket" not in out.stdout.decode()


def test_read_progress_runs_one_command_and_judges_each_instance(deployed: tuple[FakeHost, Path],
                                                                 tmp_path: Path) -> None:
    fake, path = deployed
    fake.progress_pages = {"ernie-vllm-0": [page(1, 0, 5), page(1, 0, 5)]}
    plan = _plan(tmp_path)
    session = connector({"a": fake})(target_for(_hosts(path)[0], ()))
    found = read_progress(session, plan, Thresholds(window_s=2, min_tokens=1))
    assert {u: p.state for u, p in found.items()} == {"ernie-vllm-0": "stalled", "ernie-vllm-1": "idle"}
    assert "over 2 s" in found["ernie-vllm-0"].evidence and session.commands == 1
    (cmd,) = _progress_commands(fake)
    assert json.loads(cmd.stdin)["window"] == 2 and cmd.timeout > 2


def test_an_idle_instance_whose_completion_gets_no_answer_is_not_generating(tmp_path: Path) -> None:
    """The host program sends each idle instance a 1-token completion; one whose engine hung with its gauges at
    0 never answers it, and that, not the gauges, makes it `not-generating`; one that answers stays idle."""
    idle = page(0, 0, 100)
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(idle.encode())

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path.startswith("/hung/"):
                release.wait(10)  # bounded: the test releases it once the program has given up
                return
            body = b'{"object": "text_completion", "choices": [{"text": "x"}]}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    intent = ReadProgress(("hung", "fine"), (f"{base}/hung/metrics", f"{base}/fine/metrics"), 5)
    spec = {"instances": [{"id": u, "url": url, "probe": {"url": f"{base}/{u}/v1/completions",
                                                          "body": {"model": "m", "max_tokens": 1}}}
                          for u, url in zip(intent.units, intent.urls, strict=True)],
            "api_key": None, "window": 5, "timeout": 5, "limit": 1 << 20, "probe_timeout": 0.5,
            "families": ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total"],
            "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
            "mark": "@@ernie-deploy:progress "}
    try:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", PROGRAM], input=json.dumps(spec).encode(), capture_output=True,
                             timeout=30, check=True)
        waited = time.monotonic() - t0
    finally:
        release.set()
        server.shutdown()
    assert waited < 5  # no window: nothing had work; the probes ran side by side, bounded by their timeout
    readings = parse(out.stdout.decode(), intent)
    hung, fine = readings["hung"][2], readings["fine"][2]
    assert hung is not None and hung.timed_out and fine is not None and fine.status == 200
    th = Thresholds(probe_timeout_s=0.5)
    verdict = judge(readings["hung"][0], readings["hung"][1], th, host="h1", instance="0", probe=hung)
    assert verdict.state == "not-generating" and not verdict.healthy()
    assert "got no answer within 0.5 s" in verdict.evidence and "restart -i INV -l h1 --instance 0" in str(verdict.fix)
    assert judge(readings["fine"][0], None, th, probe=fine).state == "idle"
