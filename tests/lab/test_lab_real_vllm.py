"""The tool on real vLLM (its CPU build) in the lab: provision → deploy → verify, a rolling restart under load
through the hooks, an engine and a TP worker killed under load that come back by themselves, a TP-2 drain that
runs past its timeout, a start-up real vLLM refuses that the planner cannot foresee, rolled back, and a load
test with real `vllm bench serve`. The rolling restart goes through the lab's HAProxy, lb-real, and the hooks at
once.

One lab of two real-vLLM hosts (ernie_deploy/data/lab-real-vllm.yml: real-1 serves at TP 1, real-2 at TP 2)
is booted, provisioned and deployed once for the module; the tests run in file order on it. Real start-ups take
a minute or more on 2 cores (docs/lab.md), so each test restarts as few instances as it can.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import BalancerSpec, Lab, LabState, load_spec
from ernie_deploy.lab.access import BALANCER_GROUP, balancer_group
from ernie_deploy.lab.spec import DEFAULT_SPEC
from lab.conftest import require_lab
from lab.haproxy import LabBalancer, drained_then_ready
from lab.labhelpers import drop_balancers, wait_for
from lab.loadgen import LoadBalancer, complete, healthy, hook, through

pytestmark = [pytest.mark.lab, pytest.mark.real_vllm]

SPEC = DEFAULT_SPEC.with_name("lab-real-vllm.yml")
MODEL = "ERNIE-4.5-0.3B-PT"
UNIT = "ernie-vllm-0.service"
PLANNED_TP = {"real-1": 1, "real-2": 2}
# real-2 drains for 5 s (--shutdown-timeout 5; TimeoutStopSec 20), so a drain that runs past it is quick to see.
DRAIN = {"real-2": 5}


def write_inventory(state: LabState, path: Path, balancers: bool = False, **host_vars: dict[str, Any]) -> Path:
    data = yaml.safe_load(Path(state.inventory).read_text())
    if balancers:
        specs = [BalancerSpec(b.name, b.address) for b in state.balancers]
        data["all"]["children"][BALANCER_GROUP] = balancer_group(specs, Path(state.key), Path(state.known_hosts))
    hosts = data["all"]["children"]["lab_real"]["hosts"]
    for name, seconds in DRAIN.items():
        hosts[name]["vllm_drain_timeout"] = seconds
    for name, extra in host_vars.items():
        hosts[name].update(extra)
    path.write_text(yaml.safe_dump(data))
    return path


def run(capsys: pytest.CaptureFixture[str], command: str, inv: Path, *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([command, "-i", str(inv), "--json", *args])
    doc = json.loads(capsys.readouterr().out)
    doc["by_host"] = {h["host"]: h for h in doc["hosts"]} if isinstance(doc["hosts"], list) else doc["hosts"]
    return rc, doc


def backend(state: LabState, host: str) -> str:
    return f"{state.host(host).address}:8000"


def main_pid(lab: Lab, host: str) -> str:
    return lab.ssh(host, f"systemctl show -p MainPID --value {UNIT}").stdout.strip()


@pytest.fixture(scope="module")
def real_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    the_lab = Lab(tmp_path_factory.mktemp("real-lab"), progress=lambda m: sys.stderr.write(f"[real lab] {m}\n"))
    try:
        # lb-real joins only the last test's inventory; the tests before it restart without a balancer.
        drop_balancers(Path(the_lab.up(load_spec(SPEC)).inventory))
        yield the_lab
    finally:
        the_lab.down()


@pytest.fixture(scope="module")
def deployed(real_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Both hosts provisioned from the lab's package index and deployed; the inventory's path."""
    state = real_lab.require_state()
    inv = write_inventory(state, tmp_path_factory.mktemp("real-inv") / "inventory.yml")
    os.environ["ERNIE_DEPLOY_STATE_DIR"] = str(tmp_path_factory.mktemp("real-rollouts"))
    try:
        assert main(["provision", "-i", str(inv)]) == 0
        assert main(["deploy", "-i", str(inv)]) == 0
        yield inv
    finally:
        os.environ.pop("ERNIE_DEPLOY_STATE_DIR", None)


def test_provisioned_real_vllm_passes_every_check_with_real_tp_evidence(
        capsys: pytest.CaptureFixture[str], real_lab: Lab, deployed: Path) -> None:
    rc, doc = run(capsys, "facts", deployed)
    assert rc == 0
    for name in PLANNED_TP:
        host = doc["by_host"][name]
        # From the installed package's metadata; the local label maps to the 0.32 driver row.
        assert host["facts"]["vllm_version"] == "0.32.0+cpu", host
        assert host["driver_check"]["ok"] and "unverified" not in host["driver_check"]["summary"], host
    rc, doc = run(capsys, "verify", deployed)
    assert rc == 0, {h: [c for c in r["checks"] if c["status"] != "pass"] for h, r in doc["by_host"].items()}
    for name, tp in PLANNED_TP.items():
        checks = {c["name"]: c for c in doc["by_host"][name]["checks"]}
        tp_check = checks["tensor_parallel"]
        assert tp_check["status"] == "pass"
        assert tp_check["summary"].startswith(f"Using tensor parallel size {tp} ✓ (vLLM's engine config says "
                                              f"tensor_parallel_size={tp}")
        # Real vLLM's own lines: the V1 engine-config line, and a line from each rank (its parallel_state rank
        # line, or at TP > 1 a line its `Worker_TP<r>` process logged).
        evidence = tp_check["evidence"]
        assert any("Initializing a V1 LLM engine (v0.32.0)" in line and f"tensor_parallel_size={tp}" in line
                   for line in evidence)
        for rank in range(tp):
            assert any(f"TP rank {rank}," in line or f"(Worker_TP{rank} pid=" in line for line in evidence), evidence
        assert checks["http_completion"]["status"] == "pass"
        # The simulated GPUs see the real workers: one compute app per rank, on the instance's GPUs.
        assert checks["gpus_in_use"]["status"] == "pass", checks["gpus_in_use"]
        assert checks["gpu_foreign_processes"]["status"] == "pass", checks["gpu_foreign_processes"]
    apps = real_lab.ssh("real-2", "nvidia-smi --query-compute-apps=process_name --format=csv,noheader").stdout
    assert sorted(apps.split()) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]


def test_live_metrics_show_the_families_the_data_file_records_for_032(real_lab: Lab, deployed: Path) -> None:
    """What `export prometheus` checks its rules and dashboard against (data/vllm_metrics/0.32.0.txt, read from the
    wheel) is what the running real vLLM serves: every vllm:* family on each live page, with its type."""
    from ernie_deploy.export.prometheus import metric_names

    families = metric_names("0.32.0").families
    state = real_lab.require_state()
    for name in PLANNED_TP:
        with urllib.request.urlopen(f"http://{backend(state, name)}/metrics", timeout=10) as answer:
            types = re.findall(r"^# TYPE (vllm:\S+) (\S+)$", answer.read().decode(), re.MULTILINE)
        # A counter's TYPE line names <family>_total, and each family has a <family>_created gauge beside it.
        page = {n.removesuffix("_total") if k == "counter" else n: k for n, k in types if not n.endswith("_created")}
        assert {"vllm:num_requests_running", "vllm:generation_tokens", "vllm:kv_cache_usage_perc"} <= set(page)
        assert {f: families[f].kind for f in page if f in families} == page, name


def test_rolling_restart_under_load_through_lb_real_and_the_hooks_loses_no_request(
        capsys: pytest.CaptureFixture[str], real_lab: Lab, deployed: Path, tmp_path: Path) -> None:
    """lb-real joins the inventory: deploy configures and starts its HAProxy (the instances are unchanged, nothing
    restarts). A rolling restart of both instances then drives lb-real (drain before each stop, ready once real
    vLLM passed its readiness gate) and runs the hooks as well, under a light load through lb-real's frontend and
    another through the hooks' rotation: no request fails on either. HAProxy is stopped afterwards, so its health
    checks (a one-token completion per check) do not load the later tests' 2 cores."""
    state = real_lab.require_state()
    balanced = write_inventory(state, tmp_path / "balanced.yml", balancers=True)
    data = yaml.safe_load(balanced.read_text())
    # A check every 3 s instead of the lab's 1 s: on 2 cores each is a real completion beside a TP-2 start-up.
    data["all"]["children"][BALANCER_GROUP]["vars"]["vllm_balancer_check_interval"] = 3
    balanced.write_text(yaml.safe_dump(data))
    before = {h: main_pid(real_lab, h) for h in PLANNED_TP}
    balancer = LabBalancer(real_lab, "lb-real")
    try:
        rc, doc = run(capsys, "deploy", balanced)
        assert rc == 0 and doc["by_host"]["lb-real"]["status"] == "changed", \
            [(h["host"], h["status"], h["message"]) for h in doc["hosts"]]
        assert {h: main_pid(real_lab, h) for h in PLANNED_TP} == before
        assert wait_for(balancer.all_up, 60), balancer.stats()
        assert set(balancer.stats()) == {f"{h}-0" for h in PLANNED_TP}

        rotation = tmp_path / "rotation.json"
        rotation.write_text(json.dumps([backend(state, h) for h in PLANNED_TP]))
        # A light load (one client on each path, pausing between requests): on 2 cores a saturating one starves
        # the restarting TP-2 instance's rank that shares a CPU with the serving instance (its start took 7.8 min).
        direct = LoadBalancer(rotation, MODEL, workers=1, max_seconds=900, stream_tokens=16, tokens=8,
                              request_timeout=180, pause=1.5)
        fronted = through(balancer.frontend, MODEL, tmp_path, workers=1, max_seconds=900, stream_tokens=16,
                          tokens=8, request_timeout=180, pause=1.5)
        # And one stream that is surely in flight on real-1 (restarted first) when the hook takes it out of rotation.
        first = backend(state, "real-1")
        in_flight: dict[str, tuple[float, float, bool, str]] = {}

        def long_stream() -> None:
            t0 = time.time()
            # 256 tokens: ~25 s or more on 2 cores, longer than the restart takes to reach real-1's pre-drain hook
            # (64 tokens ended 0.8 s before it in one run).
            ok, detail = complete(first, MODEL, True, 256, timeout=180)
            in_flight["stream"] = (t0, time.time(), ok, detail)

        streamer = threading.Thread(target=long_stream, daemon=True)
        since = time.time()
        direct.start()
        fronted.start()
        try:
            time.sleep(2.0)
            streamer.start()
            time.sleep(0.5)
            # The idle wait lets requests in flight finish however slow they are: on 2 cores a 24-token stream on
            # the TP-2 instance took over 90 s while the other instance started (measured), past the 60 s default.
            rc, doc = run(capsys, "restart", balanced, "--serial", "1", "--pre-drain", hook(rotation, "remove"),
                          "--post-ready", hook(rotation, "add"), "--idle-timeout", "300")
            time.sleep(2.0)
        finally:
            outcomes = direct.finish()
            through_lb = fronted.finish()
            streamer.join(timeout=180)
        assert rc == 0, [(h["host"], h["message"]) for h in doc["hosts"]]
        assert all(main_pid(real_lab, h) != pid for h, pid in before.items())
        for name, seen in (("through the hooks' rotation", outcomes), ("through lb-real", through_lb)):
            lost = [o for o in seen if not o.ok]
            assert not lost, (name, lost[:5])
            assert len(seen) > 10 and any(o.stream for o in seen), (name, len(seen))
        removals = direct.removals()
        assert [b for _, b in removals] == [backend(state, h) for h in PLANNED_TP]
        # The stream in flight on real-1 when the hook took it out of rotation ran to its end: the drain waited.
        t0, t1, ok, _ = in_flight["stream"]
        assert t0 < removals[0][0] < t1 and ok, (in_flight, removals)
        assert all(o.ok for o in outcomes if any(b == o.backend and o.started < t < o.ended for t, b in removals))
        # lb-real drained each server before its stop and set it ready after real vLLM passed its gate.
        events = balancer.events(since)
        for h in PLANNED_TP:
            assert drained_then_ready(events.get(f"{h}-0", [])), events
        assert wait_for(balancer.all_up, 60), balancer.stats()
        for h in doc["hosts"]:
            assert {"drain", "stop", "gpu_release", "load", "ready"} <= set(h["timings"][UNIT]), h["timings"]
    finally:
        real_lab.ssh("lb-real", "systemctl disable --now -q haproxy.service")


# (host, the real process killed): real-1's engine (TP 1), then one of real-2's two workers (TP 2). Real vLLM names
# them in its command line (tests/fixtures/real-vllm/0.32.0/README.md); the oldest match is the one to kill.
KILLS = (("real-1", "VLLM::EngineCore"), ("real-2", "VLLM::Worker_TP1"))
# systemd's RestartSec (10 s) plus a real start-up beside a light load on 2 cores (35-90 s, docs/lab.md), with room.
BACK_WITHIN = 420


def test_a_killed_engine_or_worker_comes_back_serving_by_itself_and_status_tells_the_story(
        capsys: pytest.CaptureFixture[str], real_lab: Lab, deployed: Path, tmp_path: Path) -> None:
    """kill -9 of real-1's EngineCore, then of real-2's second TP worker, under a light load through lb-real. Real
    vLLM exits 0 after either death (vLLM #48966; the captures), so only the unit's Restart=always brings each back:
    no operator acts. Each serves again through lb-real, its journal shows the clean exit and systemd's restart,
    and `status` tells the death by real vLLM's own line, the restart and how long it took to serve again."""
    state = real_lab.require_state()
    balanced = write_inventory(state, tmp_path / "balanced.yml", balancers=True)
    data = yaml.safe_load(balanced.read_text())
    data["all"]["children"][BALANCER_GROUP]["vars"]["vllm_balancer_check_interval"] = 3  # as the rolling test
    balanced.write_text(yaml.safe_dump(data))
    balancer = LabBalancer(real_lab, "lb-real")
    try:
        rc, doc = run(capsys, "deploy", balanced)
        assert rc == 0, [(h["host"], h["status"], h["message"]) for h in doc["hosts"]]
        real_lab.ssh("lb-real", "systemctl is-active -q haproxy || systemctl start haproxy")
        assert wait_for(balancer.all_up, 120), balancer.stats()
        fronted = through(balancer.frontend, MODEL, tmp_path, workers=1, max_seconds=1200, stream_tokens=16,
                          tokens=8, request_timeout=180, pause=1.5)
        since = {h: real_lab.ssh(h, "date +%s").stdout.strip() for h, _ in KILLS}

        def serves_anew(host: str, before: str) -> bool:
            """A new main process (systemd's restart, no operator) that answers /health 200."""
            return main_pid(real_lab, host) not in ("0", "", before) and healthy(backend(state, host))

        back_at: dict[str, float] = {}
        fronted.start()
        try:
            time.sleep(3.0)
            for host, name in KILLS:
                before = main_pid(real_lab, host)
                killed = real_lab.ssh(host, f"kill -9 \"$(pgrep -o -f '^{name}')\"")
                assert killed.returncode == 0, killed.stderr
                assert wait_for(functools.partial(serves_anew, host, before), BACK_WITHIN), f"{host} not back"
                assert wait_for(balancer.all_up, 120), balancer.stats()
                back_at[host] = time.time()
            time.sleep(6.0)
        finally:
            outcomes = fronted.finish()
        # The fleet served through it all and after: requests completed once both instances were back.
        last = max(back_at.values())
        assert any(o.ok and o.started > last for o in outcomes), len(outcomes)
        assert sum(o.ok for o in outcomes) > 2 * sum(not o.ok for o in outcomes), [o.detail[:80] for o in outcomes
                                                                                   if not o.ok][:5]
        for host, _ in KILLS:
            journal = real_lab.ssh(host, f"journalctl -u {UNIT} --since @{since[host]} --no-pager -o cat").stdout
            assert "Deactivated successfully" in journal, journal[-3000:]  # exit 0: on-failure would stay down
            assert "Scheduled restart job, restart counter is at 1." in journal, journal[-3000:]
        rc, doc = run(capsys, "status", balanced)
        for host, _ in KILLS:
            (inst,) = doc["by_host"][host]["instances"]
            death = inst["death"]
            assert inst["restarts"] == 1 and death is not None and death["serving"], inst
            assert "restarted by systemd, serving again after" in death["text"], death
        assert "engine core exited unexpectedly" in doc["by_host"]["real-1"]["instances"][0]["death"]["text"]
        assert "Worker proc VllmWorker-1 died unexpectedly" in \
            doc["by_host"]["real-2"]["instances"][0]["death"]["text"]
    finally:
        real_lab.ssh("lb-real", "systemctl disable --now -q haproxy.service")


def test_tp2_drain_past_its_timeout_ends_by_systemds_deadline_named_and_the_next_start_passes_the_gpu_gate(
        capsys: pytest.CaptureFixture[str], real_lab: Lab, deployed: Path) -> None:
    """Real vLLM at TP 2 whose drain (--shutdown-timeout 5) runs past its timeout with a stream in flight. vLLM
    0.32 races here (tests/fixtures/real-vllm/0.32.0/README.md): either it cuts the stream and exits about a second
    after the timeout, or its API server waits for the connection until systemd's SIGKILL (TimeoutStopSec 20).
    Either way the stop ends by systemd's deadline, the result names a SIGKILL exactly when systemd sent one, the
    stream is cut, and the new process passes the GPU-release gate, starts and verifies."""
    state = real_lab.require_state()
    result: dict[str, tuple[bool, str]] = {}
    # A stream far longer than the drain: ~10 tokens/s on 2 cores, so 2,000 tokens outlast it by minutes.
    streamer = threading.Thread(target=lambda: result.setdefault(
        "stream", complete(backend(state, "real-2"), MODEL, True, 2000, timeout=120)), daemon=True)
    since = real_lab.ssh("real-2", "date +%s").stdout.strip()
    streamer.start()
    time.sleep(3.0)
    rc, doc = run(capsys, "restart", deployed, "--limit", "real-2", "--idle-timeout", "1")
    streamer.join(timeout=60)
    host = doc["by_host"]["real-2"]
    assert rc == 0, host["message"]
    timings = host["timings"][UNIT]
    journal = real_lab.ssh("real-2", f"journalctl -u {UNIT} --since @{since} --no-pager -o cat").stdout
    killed = "timed out. Killing." in journal
    warned = [c for c in host["checks"] if c["name"] == "stop" and c["status"] == "warn"]
    assert timings["stop"] < DRAIN["real-2"] + 15 + 10, timings
    if killed:
        assert warned and "killed (SIGKILL)" in warned[0]["summary"], host["checks"]
        assert timings["stop"] >= 15.0, timings
    else:
        assert not warned and timings["stop"] < 15.0, (timings, host["checks"])
        assert "[shutdown] API server: stopping engine client mode=drain timeout=5s" in journal
    assert "gpu_release" in timings and "ready" in timings
    ok, detail = result["stream"]
    assert not ok, detail  # cut, not finished: the drain ran out
    assert healthy(backend(state, "real-2"))


def test_a_start_real_vllm_refuses_is_rolled_back_with_its_error_and_serves_again(
        capsys: pytest.CaptureFixture[str], real_lab: Lab, deployed: Path, tmp_path: Path) -> None:
    """A change real vLLM refuses at start-up that no plan can foresee: the new port is held by another process
    on the host (real vLLM's own `OSError: [Errno 98] Address already in use`). The deploy fails real-1, quotes
    the error with its cause and fix, rolls it back to the release that ran, and it serves again; status finds
    no drift; logs shows the real lines of the run that serves. (A context length the CPU KV space cannot hold,
    real vLLM's "To serve at least one request ...", is foreseen by the plan: tests/test_cpu_backend.py.)"""
    state = real_lab.require_state()
    before = main_pid(real_lab, "real-1")
    files = f"/etc/systemd/system/{UNIT} /etc/ernie-deploy/ernie-vllm-0.env"
    installed = real_lab.ssh("real-1", f"cat {files}").stdout
    address = state.host("real-1").address
    squat = real_lab.ssh("real-1", f"systemd-run --unit squat-8001 python3 -m http.server 8001 --bind {address}")
    assert squat.returncode == 0, squat.stderr
    try:
        bad = write_inventory(state, tmp_path / "bad.yml", **{"real-1": {"vllm_port": 8001}})
        rc, doc = run(capsys, "deploy", bad, "--limit", "real-1")
    finally:
        real_lab.ssh("real-1", "systemctl stop squat-8001")
    host = doc["by_host"]["real-1"]
    assert rc == 2 and host["status"] == "failed", host["message"]
    assert host["message"] == "ernie-vllm-0: OSError: [Errno 98] Address already in use"
    assert "ss -ltnp 'sport = :8001'" in host["hint"]
    assert any("rolled back to release" in x and "ready and verified" in x for x in host["rollbacks"]), host
    assert real_lab.ssh("real-1", f"cat {files}").stdout == installed
    assert main_pid(real_lab, "real-1") != before and healthy(backend(state, "real-1"))
    assert complete(backend(state, "real-1"), MODEL, False, 4)[0]

    rc, doc = run(capsys, "status", deployed)
    assert rc == 0 and all(h["drift"] == [] for h in doc["by_host"].values()), doc
    capsys.readouterr()
    assert main(["logs", "-i", str(deployed), "real-1", "-n", "400"]) == 0
    out = capsys.readouterr().out
    assert f"Starting vLLM server on http://{address}:8000" in out
    assert "CPU KV cache size: 58,240 tokens" in out and "Address already in use" not in out


def test_bench_runs_real_vllm_bench_serve_from_the_provisioned_venv_and_meets_a_generous_slo(
        capsys: pytest.CaptureFixture[str], real_lab: Lab, deployed: Path, tmp_path: Path) -> None:
    """`bench --limit real-1` with a tiny workload: real `vllm bench serve` (the provisioned venv's, as the service
    user, the model directory as its tokenizer, offline) against real vLLM's CPU build; every request completes,
    the latencies are there and a generous TTFT SLO is judged and met."""
    state = real_lab.require_state()
    slo = write_inventory(state, tmp_path / "slo.yml", False, **{"real-1": {"vllm_slo_ttft_p99_ms": 60000}})
    rc, doc = run(capsys, "bench", slo, "--limit", "real-1", "--num-prompts", "4", "--input-len", "32",
                  "--output-len", "16", "--timeout", "120", "--save", str(tmp_path))
    (inst,) = doc["by_host"]["real-1"]["instances"]
    assert rc == 0 and inst["status"] == "ok", inst["message"]
    # The provisioned venv's own vllm (/opt/vllm/VERSION/bin/vllm), not the simulator's.
    assert inst["argv"][0].startswith("/opt/vllm/0.32.0") and inst["argv"][1:3] == ["bench", "serve"], inst["argv"]
    result = inst["result"]
    assert result["completed"] == 4 and not result["failed"] and not result["partial"], result
    assert result["latency_ms"]["ttft"]["p99"] > 0 and result["latency_ms"]["tpot"]["p99"] > 0, result
    assert [(v["slo"], v["ok"]) for v in inst["verdicts"]] == [("ttft_p99_ms", True), ("requests", True)]
    assert json.loads(Path(inst["saved"]).read_text())["completed"] == 4
    with capsys.disabled():  # the README's bench row, for a run with -s
        ms = result["latency_ms"]
        print(f"\n| real-1 | {ms['ttft']['p50']:.1f} / {ms['ttft']['p99']:.1f} | {ms['tpot']['p50']:.2f} / "
              f"{ms['tpot']['p99']:.2f} | {ms['itl']['p99']:.2f} | {result['output_throughput']:.1f} | "
              f"{result['request_throughput']:.2f} |")
