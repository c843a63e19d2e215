"""The progress watchdog against the lab (issue 28): a stalled simulated instance answers /health 200, and `status`,
`verify` and `watch --restart-stalled` see through it.

One host, a10-2, serves the model from two TP-1 instances (ports 8000 and 8001). Instance 1 gets work (two long
streams), then the simulator's `stall` fault (docs/lab.md, "Fault knobs"): its engine hangs with the requests
running. `status` and `verify` must name it stalled with the readings (exit 2); `watch --restart-stalled` must
restart it through the restart cycle while instance 0 keeps serving a light bounded load without a failed request
and never stops answering; afterwards `status` is clean. The restarted process serves though the knob is still
set (the stall belongs to the process it hit, as a real hang does). Cheap: the session lab, one host, quick loads,
one progress window per read.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import clean
from lab.loadgen import LoadBalancer, Sampler
from lab.test_lab_deploy import start_times

pytestmark = pytest.mark.lab

FAULTS = "/etc/ernie-lab/faults.json"
HOST = "a10-2"
QUICK = {"load_seconds": 1}
STALLED = {**QUICK, "ports": {"8001": {"stall": True}}}
# Two TP-1 instances of the model on a10-2; a stalled instance's in-flight requests held for at most 2 s on its stop
# (--shutdown-timeout), so a restart of it costs seconds. The progress window is the default, 5 s.
HOST_VARS = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1, "vllm_drain_timeout": 2,
             # a 2 s progress window and a 3 s idle probe (docs/progress.md): the test waits less
             "vllm_progress_window": 2, "vllm_progress_probe_timeout": 3}
STALL_SEEN_S = 1.0  # the simulator re-reads faults.json every 0.2 s


def faults(lab: Lab, data: dict[str, Any]) -> None:
    lab.ssh(HOST, f"mkdir -p /etc/ernie-lab && cat > {FAULTS}", input=json.dumps(data))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def pair(lab: Lab, lab_state: LabState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """a10-2 deployed with two instances of the model; the inventory's path. Cleaned before and after."""
    clean(lab, lab_state)
    faults(lab, QUICK)
    data = yaml.safe_load(Path(lab_state.inventory).read_text())
    data["all"]["children"]["lab"]["hosts"][HOST].update(HOST_VARS)
    inv = tmp_path_factory.mktemp("progress") / "inventory.yml"
    inv.write_text(yaml.safe_dump(data))
    try:
        assert main(["deploy", "-i", str(inv), "--limit", HOST, "--startup-budget", "60"]) == 0
        yield inv
    finally:
        lab.ssh(HOST, f"rm -f {FAULTS}")
        clean(lab, lab_state)


class Streams:
    """Long completion streams to one instance, read on threads, so it has requests running when it stalls."""

    def __init__(self, address: str, port: int, count: int) -> None:
        self.conns: list[http.client.HTTPConnection] = []
        self.sockets: list[socket.socket] = []
        self.events = [0] * count
        self.threads: list[threading.Thread] = []
        for k in range(count):
            conn = http.client.HTTPConnection(address, port, timeout=60)
            body = {"prompt": f"stall {k}", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            assert conn.sock is not None
            self.sockets.append(conn.sock)
            resp = conn.getresponse()
            assert resp.status == 200
            self.conns.append(conn)
            t = threading.Thread(target=self._read, args=(k, resp), daemon=True)
            t.start()
            self.threads.append(t)

    def _read(self, k: int, resp: http.client.HTTPResponse) -> None:
        try:
            for line in resp:
                if line.startswith(b"data: "):
                    self.events[k] += 1
        except (OSError, http.client.HTTPException):
            return  # cut when the stalled instance is restarted: expected

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in self.threads:
            t.join(timeout=5)
        for conn in self.conns:
            conn.close()


def wait_until(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def instances(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {i["unit"].removesuffix(".service"): i for i in doc["hosts"][HOST]["instances"]}


def watchdog_restarts_instance_1(capsys: pytest.CaptureFixture[str], lab: Lab, pair: Path,
                                 before: dict[str, str]) -> dict[str, Any]:
    """`watch --restart-stalled` restarts instance 1 and only it; its JSON. Rounds of one 2 s window each: --for
    leaves the first round time to decide on a restart, and the round after the restart (at once) judges it."""
    rc, doc = cli(capsys, "watch", "-i", str(pair), "--limit", HOST, "--restart-stalled", "--for", "8",
                  "--every", "8", "--idle-timeout", "1", "--no-slo-gate", "--startup-budget", "60")
    assert rc == 0, json.dumps(doc, indent=1)
    restarts = [d for r in doc["rounds"] for d in r["decisions"]]
    assert [(d["unit"].removesuffix(".service"), d["outcome"]) for d in restarts] == [
        ("ernie-vllm-1", "restarted")], restarts
    after = start_times(lab, HOST)
    assert after["ernie-vllm-1.service"] != before["ernie-vllm-1.service"]
    assert after["ernie-vllm-0.service"] == before["ernie-vllm-0.service"]
    return doc


def test_a_stalled_instance_is_named_by_status_and_verify_and_restarted_by_the_watchdog_without_lost_capacity(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, pair: Path, tmp_path: Path) -> None:
    address = lab_state.host(HOST).address
    healthy, sick = f"{address}:8000", f"{address}:8001"
    rotation = tmp_path / "rotation.json"
    rotation.write_text(json.dumps([healthy]))  # the load's path: instance 0 only, which must never fail
    load = LoadBalancer(rotation, "ERNIE-4.5-0.3B-PT", workers=2, stream_tokens=40, tokens=8, pause=0.2,
                        max_seconds=120)
    sampler = Sampler({HOST: [healthy]})
    streams = Streams(address, 8001, 2)
    before_restart = start_times(lab, HOST)
    load.start()
    sampler.start()
    try:
        assert wait_until(lambda: min(streams.events) > 5, 10), "the streams to instance 1 never got going"
        faults(lab, STALLED)
        time.sleep(STALL_SEEN_S)
        stalled_at = list(streams.events)

        rc, doc = cli(capsys, "status", "-i", str(pair), "--limit", HOST)
        assert rc == 2, json.dumps(doc, indent=1)
        seen = instances(doc)
        assert seen["ernie-vllm-1"]["progress"]["state"] == "stalled"
        assert seen["ernie-vllm-1"]["health"] is not None  # /health still answers: only the progress check sees it
        assert "running 2→2" in seen["ernie-vllm-1"]["progress"]["evidence"]
        assert seen["ernie-vllm-0"]["progress"]["state"] in ("ok", "idle")
        drift = [d for d in doc["hosts"][HOST]["drift"] if d["kind"] == "progress"]
        assert len(drift) == 1 and "ernie-vllm-1" in drift[0]["message"], drift

        rc, doc = cli(capsys, "verify", "-i", str(pair), "--limit", HOST)
        assert rc == 2, json.dumps(doc, indent=1)
        failed = [c for h in doc["hosts"] for c in h["checks"] if c["status"] == "fail"]
        assert {c["instance"] for c in failed} == {"ernie-vllm-1"}, failed
        # Its smoke completion is not sent (it could only time out); the progress check says why, with the readings.
        assert sorted(c["name"] for c in failed) == ["http_completion", "progress"], failed
        assert next(c for c in failed if c["name"] == "http_completion")["summary"].startswith(
            "smoke completion not sent: the engine is stalled"), failed
        progress = next(c for c in failed if c["name"] == "progress")
        assert "stalled" in progress["summary"] and "running 2→" in progress["summary"], progress
        assert streams.events == stalled_at  # nothing came out of the stalled engine meanwhile

        doc = watchdog_restarts_instance_1(capsys, lab, pair, before_restart)
        assert all(i["healthy"] for i in doc["end"]["instances"]), doc["end"]

        rc, doc = cli(capsys, "status", "-i", str(pair), "--limit", HOST)
        assert rc == 0, json.dumps(doc, indent=1)
        assert all(i["progress"]["state"] in ("ok", "idle") for i in instances(doc).values())
        assert not doc["hosts"][HOST]["drift"]
    finally:
        outcomes = load.finish()
        samples = sampler.finish()
        streams.close()
        faults(lab, QUICK)
    lost = [o for o in outcomes if not o.ok]
    assert outcomes and not lost, lost[:3]
    assert samples and not any(down for _, down in samples), "instance 0 stopped answering"
    assert sick not in {o.backend for o in outcomes}


def test_an_engine_hung_while_idle_is_not_generating_for_status_and_restarted_by_the_watchdog(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, pair: Path, tmp_path: Path) -> None:
    """The stall hits instance 1 while it has nothing to do, as under short requests: its gauges freeze at idle
    and /health answers 200, so only a request shows it. `status` names it not generating (its 1-token probe got
    no answer), not healthy and not the network; `watch --restart-stalled` restarts it while instance 0 keeps
    serving a bounded load with no failed request."""
    address = lab_state.host(HOST).address
    healthy = f"{address}:8000"
    rotation = tmp_path / "rotation.json"
    rotation.write_text(json.dumps([healthy]))
    load = LoadBalancer(rotation, "ERNIE-4.5-0.3B-PT", workers=2, stream_tokens=40, tokens=8, pause=0.2,
                        max_seconds=120)
    before_restart = start_times(lab, HOST)
    load.start()
    try:
        faults(lab, STALLED)
        time.sleep(STALL_SEEN_S)
        rc, doc = cli(capsys, "status", "-i", str(pair), "--limit", HOST)
        assert rc == 2, json.dumps(doc, indent=1)
        seen = instances(doc)
        assert seen["ernie-vllm-1"]["health"] == "200"
        progress = seen["ernie-vllm-1"]["progress"]
        assert progress["state"] == "not-generating", progress
        assert "no requests running or waiting" in progress["evidence"] and "got no answer within 3 s" in \
            progress["evidence"], progress
        drift = [d for d in doc["hosts"][HOST]["drift"] if d["kind"] == "progress"]
        assert len(drift) == 1 and "restart" in drift[0]["fix"], drift

        watchdog_restarts_instance_1(capsys, lab, pair, before_restart)
    finally:
        outcomes = load.finish()
        faults(lab, QUICK)
    lost = [o for o in outcomes if not o.ok]
    assert outcomes and not lost, lost[:3]
