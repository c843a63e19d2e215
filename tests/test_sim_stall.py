"""The simulated vLLM's `stall` fault (vllm_hang.py): /health stays 200 while the engine makes no progress.

Runs the simulator as `tests/test_sim_vllm.py` does (its Lab and Server helpers: own session, SIGKILLed in a
finalizer, every wait bounded).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_sim_vllm import Lab, Server, free_port

from ernie_deploy.checks.progress import MetricsError, Thresholds, judge, parse_reading
from ernie_deploy.lab.sim.vllm_hang import StallWatch, stall_mode
from ernie_deploy.lab.sim.vllm_http import ServerState
from ernie_deploy.lab.sim.vllm_versions import profile_for

STALL_SEEN_S = 1.0  # the knob is polled every 0.2 s; this leaves room on a loaded machine


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    yield lab
    lab.kill_all()


def gauge(text: str, name: str) -> float:
    """The value of one vLLM metric (summed over its series) in a /metrics text."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def reading(server: Server) -> dict[str, float]:
    status, raw = server.request("GET", "/metrics")
    assert status == 200
    text = raw.decode()
    return {"running": gauge(text, "vllm:num_requests_running"), "waiting": gauge(text, "vllm:num_requests_waiting"),
            "generated": gauge(text, "vllm:generation_tokens_total")}


def until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


class Stream:
    """A long completion stream read on a thread, so a test can watch what arrives (and when it stops)."""

    def __init__(self, server: Server, max_tokens: int = 600, prompt: str = "long") -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body),
                          headers={"content-type": "application/json"})
        self.sock = self.conn.sock
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.events: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for raw in self.resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[6:])
        except (OSError, http.client.HTTPException):
            pass
        finally:
            self.done.set()

    def close(self) -> None:
        """Hang up (the reader thread blocked on a stalled stream sees the end at once)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=5)  # before closing the response under the reader's feet
        self.conn.close()


def stall(lab: Lab, port: int, value: Any) -> None:
    lab.faults({"ports": {str(port): {"stall": value}}})


def test_stall_keeps_health_200_freezes_tokens_and_clearing_resumes(lab: Lab) -> None:
    port = free_port()
    server = lab.start("--max-num-seqs", "3", port=port)
    server.wait_ready()
    streams = [Stream(server, prompt=f"p{i}") for i in range(2)]
    try:
        assert until(lambda: all(len(s.events) > 3 for s in streams))
        stall(lab, port, True)
        time.sleep(STALL_SEEN_S)
        before = reading(server)
        sent = [len(s.events) for s in streams]
        time.sleep(1.0)
        after = reading(server)
        # Requests accepted, nothing generated: the hung engine's last gauges stay, the token counter stops.
        assert server.request("GET", "/health")[0] == 200
        assert before["running"] == after["running"] == 2
        assert before["generated"] == after["generated"] > 0
        assert [len(s.events) for s in streams] == sent and not any(s.done.is_set() for s in streams)
        # A new request is accepted and gets nothing; the gauges the engine last reported do not move.
        late = Stream(server, max_tokens=5, prompt="late")
        streams.append(late)
        time.sleep(0.5)
        assert late.events == [] and reading(server) == after
        # Cleared: the same process resumes, every stream ends normally and the counter advances again.
        lab.faults({})
        assert until(lambda: all(s.done.is_set() for s in streams), timeout=30)
        assert all(s.events[-1] == "[DONE]" for s in streams)
        final = reading(server)
        assert final["running"] == 0 and final["generated"] == after["generated"] + sum(
            len([e for e in s.events if e != "[DONE]"]) - n for s, n in zip(streams, [*sent, 0], strict=True))
    finally:
        for s in streams:
            s.close()


def test_new_requests_pile_up_as_waiting_under_the_waiting_form(lab: Lab) -> None:
    port = free_port()
    server = lab.start(port=port)
    server.wait_ready()
    stall(lab, port, "waiting")
    time.sleep(STALL_SEEN_S)
    streams = [Stream(server, max_tokens=5, prompt=f"w{i}") for i in range(3)]
    try:
        assert until(lambda: reading(server)["waiting"] == 3)
        first = reading(server)
        time.sleep(0.5)
        assert reading(server) == first and first["running"] == 0  # stuck: a queue, nothing running, no tokens
        assert server.request("GET", "/health")[0] == 200 and all(s.events == [] for s in streams)
        lab.faults({"ports": {str(port): {"stall": False}}})
        assert until(lambda: all(s.done.is_set() for s in streams), timeout=15)
        assert all(s.events[-1] == "[DONE]" for s in streams) and reading(server)["waiting"] == 0
    finally:
        for s in streams:
            s.close()


def test_a_process_started_with_the_knob_set_serves_like_a_restarted_one(lab: Lab) -> None:
    port = free_port()
    stall(lab, port, True)
    server = lab.start(port=port)
    server.wait_ready()
    time.sleep(STALL_SEEN_S)
    status, body = server.json("POST", "/v1/completions", {"prompt": "after restart", "max_tokens": 8})
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    # Cleared and set again while it serves: now it hangs.
    lab.faults({})
    time.sleep(STALL_SEEN_S)
    stall(lab, port, "running")
    time.sleep(STALL_SEEN_S)
    stream = Stream(server, max_tokens=5)
    try:
        time.sleep(0.5)
        assert stream.events == [] and not stream.done.is_set()
    finally:
        stream.close()


def test_sigterm_ends_a_stalled_032_engine_within_its_shutdown_timeout(lab: Lab) -> None:
    """0.32 drains for --shutdown-timeout, then force-kills the hung EngineCore: the stream gets EngineDeadError."""
    lab.version("0.32.0")
    port = free_port()
    server = lab.start("--shutdown-timeout", "2", port=port)
    server.wait_ready()
    stream = Stream(server)
    try:
        assert until(lambda: len(stream.events) > 3)
        stall(lab, port, True)
        time.sleep(STALL_SEEN_S)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(timeout=15) == 0
        assert 2.0 <= time.monotonic() - started < 8.0
        assert stream.done.wait(5) and stream.events[-1] == "[DONE]"
        assert "EngineCore encountered an issue" in stream.events[-2]
        assert "[shutdown] Process manager: force killing remaining process EngineCore" in server.log
    finally:
        stream.close()


def test_sigterm_aborts_a_stalled_engine_at_once_from_0_18(lab: Lab) -> None:
    port = free_port()
    server = lab.start(port=port)
    server.wait_ready()
    stream = Stream(server)
    try:
        assert until(lambda: len(stream.events) > 3)
        stall(lab, port, True)
        time.sleep(STALL_SEEN_S)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(timeout=10) == 0
        assert stream.done.wait(5) and "[DONE]" not in stream.events  # cut, never finished
    finally:
        stream.close()


def test_a_bad_stall_value_stops_serve_naming_faults_json(lab: Lab) -> None:
    lab.faults({"stall": "sometimes"})
    out = lab.serve_fail()
    assert out.returncode == 1
    assert 'faults.json: stall must be true, "running", "waiting", false or null, got \'sometimes\'' in out.stderr


@pytest.mark.parametrize(("value", "mode"), [(True, "running"), ("running", "running"), ("waiting", "waiting"),
                                             (False, None), (None, None)])
def test_stall_values(value: Any, mode: str | None) -> None:
    assert stall_mode(value) == mode


@pytest.mark.parametrize("value", [1, "true", "yes", 0.5, [], {}])
def test_stall_rejects_other_values(value: Any) -> None:
    with pytest.raises(ValueError, match="stall must be"):
        stall_mode(value)


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_disable_log_stats_leaves_no_vllm_metrics_and_the_progress_check_never_calls_it_healthy(
        lab: Lab, version: str) -> None:
    """A real way for an instance to have no readable progress: `--disable-log-stats` (vLLM then registers no
    `vllm:` family). The page still answers 200; the progress check names it unreadable, never healthy."""
    lab.version(version)
    server = lab.start("--disable-log-stats")
    server.wait_ready()
    assert server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    status, raw = server.request("GET", "/metrics")
    text = raw.decode()
    assert status == 200 and "vllm:" not in text
    with pytest.raises(MetricsError, match="no vLLM metrics on the page"):
        parse_reading(text)
    verdict = judge(MetricsError("GET /metrics: no vLLM metrics on the page"), None, Thresholds())
    assert verdict.state == "unreadable" and not verdict.healthy()


def test_the_simulator_s_stalled_page_is_judged_stalled(lab: Lab) -> None:
    """Two pages of a stalled simulated instance, through the progress check's own parser and judgement."""
    port = free_port()
    server = lab.start(port=port)
    server.wait_ready()
    streams = [Stream(server, prompt=f"j{i}") for i in range(2)]
    try:
        assert until(lambda: all(len(s.events) > 3 for s in streams))
        busy = parse_reading(server.request("GET", "/metrics")[1].decode())
        time.sleep(0.3)
        ok = judge(busy, parse_reading(server.request("GET", "/metrics")[1].decode()), Thresholds(window_s=0.3))
        assert ok.state == "ok", ok.evidence
        stall(lab, port, True)
        time.sleep(STALL_SEEN_S)
        before = parse_reading(server.request("GET", "/metrics")[1].decode())
        time.sleep(0.5)
        after = parse_reading(server.request("GET", "/metrics")[1].decode())
        verdict = judge(before, after, Thresholds(window_s=0.5))
        assert verdict.state == "stalled" and not verdict.healthy(), verdict.evidence
        assert "running 2→2" in verdict.evidence
    finally:
        lab.faults({})
        for s in streams:
            s.close()


def test_the_watch_applies_edges_and_names_a_bad_live_value_once(capsys: pytest.CaptureFixture[str]) -> None:
    state = ServerState(profile=profile_for("0.34.0"), served_name="m", model_root="/m", max_model_len=4096,
                        kv_tokens=1000, max_num_seqs=4, api_keys=None, health_503=lambda: False,
                        on_load_change=lambda _: None, access_log=None)
    knob: dict[str, Any] = {"stall": True}
    watch = StallWatch(lambda: knob, state, threading.Event(), "/etc/ernie-lab/faults.json")
    watch.poll()
    assert state.stall_mode is None  # set before this process served: not its hang
    knob.clear()
    watch.poll()
    knob["stall"] = "waiting"
    watch.poll()
    assert state.stall_mode == "waiting" and state.frozen is None
    knob["stall"] = 7
    watch.poll()
    watch.poll()
    assert state.stall_mode == "waiting"  # a bad value leaves the engine as it was...
    err = capsys.readouterr().err
    assert err.count("stall must be true") == 1 and "/etc/ernie-lab/faults.json" in err  # ...named once
    knob["stall"] = True
    watch.poll()
    assert state.stall_mode == "running" and state.frozen == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
