"""Rolling restarts, rollouts and rollbacks against the lab's real systemd, sshd and journald (issue 13).

One module fixture deploys the default lab once (simulated loads of 1 s); each scenario leaves every host
serving its base release again, so they can share it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from ernie_deploy.orchestration import resume
from lab.haproxy import HAProxy, hook_script, running
from lab.labhelpers import CLEAN, Units, clean, wait_for
from lab.loadgen import LoadBalancer, Sampler, complete, healthy, hook
from lab.test_lab_deploy import start_times

pytestmark = pytest.mark.lab

FAULTS = "/etc/ernie-lab/faults.json"
QUICK = {"load_seconds": 1}
ROOT = Path(__file__).resolve().parent.parent.parent


def faults(lab: Lab, host: str, data: dict[str, Any]) -> None:
    lab.ssh(host, f"mkdir -p /etc/ernie-lab && cat > {FAULTS}", input=json.dumps(data))


def inventory(state: LabState, tmp: Path, name: str = "inventory.yml", **host_vars: dict[str, Any]) -> Path:
    data = yaml.safe_load(Path(state.inventory).read_text())
    for host, extra in host_vars.items():
        data["all"]["children"]["lab"]["hosts"].setdefault(host, {}).update(extra)
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*argv, "--json", "--startup-budget", "60", "--gpu-release-timeout", "20"])
    doc = json.loads(capsys.readouterr().out)
    doc["by_host"] = {h["host"]: h for h in doc["hosts"]}
    return rc, doc


@pytest.fixture(scope="module")
def fleet(lab: Lab, lab_state: LabState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every lab host deployed with its base plan; the inventory's path. Cleaned before and after."""
    clean(lab, lab_state)
    for h in lab_state.hosts:
        faults(lab, h.name, QUICK)
    os.environ["ERNIE_DEPLOY_STATE_DIR"] = str(tmp_path_factory.mktemp("rollouts"))
    inv = inventory(lab_state, tmp_path_factory.mktemp("inv"))
    try:
        rc = main(["deploy", "-i", str(inv), "--startup-budget", "60"])
        assert rc == 0
        yield inv
    finally:
        os.environ.pop("ERNIE_DEPLOY_STATE_DIR", None)
        for h in lab_state.hosts:
            lab.ssh(h.name, f"rm -f {FAULTS}")
        clean(lab, lab_state)


# A process that registers 20000 MiB on GPU 0 with the simulated nvidia-smi and holds it, named like vLLM's
# EngineCore, until its registry entry is removed (or it is killed): the simulator's own orphan holder.
LEAK = "/usr/local/bin/leak-gpu.py"
LEAK_PROGRAM = """import os, sys
sys.path.insert(0, "/opt/ernie-lab/lib")
from ernie_lab_sim import simstate, vllm_procs
gpu = simstate.load_host_gpus().gpus[0]
key = "orphan-%d" % os.getpid()
proc = simstate.GpuProc(os.getpid(), gpu.uuid, 20000, 0, "VLLM::EngineCore")
simstate.write_entry(simstate.UsageEntry(key, 0, [proc]))
vllm_procs._holder_main("EngineCore", 0, key)
"""


def batch_done(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("done") == [0]
    except (OSError, ValueError):
        return False


def backends(state: LabState) -> dict[str, list[str]]:
    return {h.name: [f"{h.address}:8000"] for h in state.hosts}


def all_healthy(state: LabState) -> bool:
    return all(healthy(b) for bs in backends(state).values() for b in bs)


def test_rolling_restart_under_load_loses_no_request(capsys: pytest.CaptureFixture[str], lab_state: LabState,
                                                      fleet: Path, tmp_path: Path) -> None:
    rotation = tmp_path / "rotation.json"
    rotation.write_text(json.dumps([b for bs in backends(lab_state).values() for b in bs]))
    lb = LoadBalancer(rotation, "ERNIE-4.5-0.3B-PT")
    sampler = Sampler(backends(lab_state))
    svg = tmp_path / "rollout.svg"
    lb.start()
    sampler.start()
    try:
        time.sleep(1.0)
        rc, doc = run(capsys, "restart", "-i", str(fleet), "--serial", "1", "--pre-drain", hook(rotation, "remove"),
                      "--post-ready", hook(rotation, "add"), "--timeline", str(svg))
        time.sleep(1.0)
    finally:
        outcomes = lb.finish()
        samples = sampler.finish()
    assert rc == 0, [(h["host"], h["message"]) for h in doc["hosts"]]
    assert doc["rollout"]["batches"] == [[h.name] for h in lab_state.hosts]
    lost = [o for o in outcomes if not o.ok]
    assert not lost, lost[:5]
    streams = [o for o in outcomes if o.stream]
    assert len(outcomes) > 50 and len(streams) > 20
    # A stream in flight when its instance was taken out of rotation ran to its end.
    # Requests in flight on an instance when the balancer took it out finished (the drain waited for them).
    removals = lb.removals()
    assert len(removals) == len(lab_state.hosts)
    draining = [o for o in outcomes if any(b == o.backend and o.started < t < o.ended for t, b in removals)]
    assert draining and all(o.ok for o in draining)
    assert len(samples) > 100 and sampler.most_hosts_down() == 1
    for h in doc["hosts"]:
        timings = h["timings"]["ernie-vllm-0.service"]
        assert {"drain", "stop", "gpu_release", "load", "ready"} <= set(timings), timings
    assert svg.read_text().count("<rect") >= 5 * len(lab_state.hosts)


def test_new_release_failing_on_the_second_batch_is_rolled_back(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                                 lab_state: LabState, fleet: Path,
                                                                 tmp_path: Path) -> None:
    """vLLM's CUDA OOM hits only the new release (a changed flag) on a10-2: the rollout stops after batch 2, a10-2
    runs its previous release again (verified), later hosts are untouched; exit 2. Then `rollback` takes a10-1
    (changed in batch 1) back to its previous unit and env byte for byte."""
    files = "/etc/systemd/system/ernie-vllm-0.service /etc/ernie-deploy/ernie-vllm-0.env"
    before = {h: lab.ssh(h, f"cat {files}").stdout for h in ("a10-1", "a10-2")}
    later = {h: start_times(lab, h) for h in ("a10-4", "a100-2")}
    faults(lab, "a10-2", {**QUICK, "when": {"max_model_len": 1536}, "fail_startup": "cuda_oom"})
    changed = {h.name: {"vllm_max_model_len": 1536} for h in lab_state.hosts}
    inv = inventory(lab_state, tmp_path, **changed)
    try:
        rc, doc = run(capsys, "deploy", "-i", str(inv), "--serial", "1")
    finally:
        faults(lab, "a10-2", QUICK)
    hosts = doc["by_host"]
    assert rc == 2 and doc["exit_code"] == 2
    assert hosts["a10-1"]["status"] == "changed" and hosts["a10-2"]["status"] == "failed"
    assert "CUDA out of memory" in hosts["a10-2"]["message"]
    assert any("rolled back to release" in x and "ready and verified" in x for x in hosts["a10-2"]["rollbacks"])
    assert [hosts[h]["status"] for h in ("a10-4", "a100-2")] == ["skipped", "skipped"]
    assert "stopped after batch 2" in doc["rollout"]["stopped"]
    assert lab.ssh("a10-2", f"cat {files}").stdout == before["a10-2"]
    assert healthy("127.0.0.12:8000")
    assert {h: start_times(lab, h) for h in later} == later

    # The release that failed is marked on a10-2 (issue 23 item 12): `releases` says when and why, and going
    # back to it wants --force.
    bad = hosts["a10-2"]["release"]
    capsys.readouterr()
    assert main(["releases", "-i", str(inv), "--limit", "a10-2", "--json"]) == 0
    kept = {r["id"]: r for r in json.loads(capsys.readouterr().out)["hosts"]["a10-2"]["releases"]}
    assert kept[bad]["failed"] and "CUDA out of memory" in kept[bad]["failed"]["reason"], kept[bad]
    assert kept[bad]["changed"] and not [r for i, r in kept.items() if i != bad and r["failed"]]
    rc, doc = run(capsys, "rollback", "-i", str(inv), "--limit", "a10-2", "--to", bad)
    assert rc == 2 and "--force" in doc["by_host"]["a10-2"]["hint"], doc["by_host"]["a10-2"]
    # status reads the vLLM each running process uses from the host (item 7): here the installed one.
    rc = main(["status", "-i", str(fleet), "--limit", "a10-2", "--json"])  # back on its base release
    seen = json.loads(capsys.readouterr().out)["hosts"]["a10-2"]
    assert rc == 0 and not seen["drift"], seen["drift"]
    assert seen["vllm"] and seen["vllm"] == seen["vllm_installed"], seen
    assert all(i["vllm"] == seen["vllm"] for i in seen["instances"]), seen["instances"]
    # A controller killed -9 after the restart leaves its pending entry and its lock (item 13, item 10): status
    # judges "waits for a restart" by what runs (nothing waits), and names the stale lock with the fix.
    stale = json.dumps({"token": "t", "user": "ops", "controller": socket.gethostname(), "pid": 2 ** 22 + 1,
                        "command": "ernie-deploy deploy", "since": time.time()})
    lab.ssh("a10-2", "echo ernie-vllm-0.service >> /var/lib/ernie-deploy/pending && "
                     "mkdir /var/lib/ernie-deploy/lock && cat > /var/lib/ernie-deploy/lock/info", input=stale)
    rc = main(["status", "-i", str(fleet), "--limit", "a10-2", "--json"])
    seen = json.loads(capsys.readouterr().out)["hosts"]["a10-2"]
    assert rc == 2 and [d["kind"] for d in seen["drift"]] == ["lock"], seen["drift"]
    assert "stale" in seen["drift"][0]["message"] and "lock -i INV --break" in seen["drift"][0]["fix"]
    assert main(["lock", "-i", str(fleet), "--break"]) == 0
    lab.ssh("a10-2", "sed -i '/^ernie-vllm-0.service$/d' /var/lib/ernie-deploy/pending")
    # rollback --check shows what it would put back, file by file, and changes nothing.
    rc, doc = run(capsys, "rollback", "-i", str(inv), "--limit", "a10-1", "--check")
    diffs = doc["by_host"]["a10-1"]["diffs"]
    assert rc == 0 and any("--max-model-len 1536" in d for d in diffs), doc["by_host"]["a10-1"]

    rc, doc = run(capsys, "rollback", "-i", str(inv), "--limit", "a10-1")
    assert rc == 0, doc["by_host"]["a10-1"]["message"]
    assert lab.ssh("a10-1", f"cat {files}").stdout == before["a10-1"]
    assert not [c for c in doc["by_host"]["a10-1"]["checks"] if c["status"] == "fail"]
    audit = lab.ssh("a10-1", "cat /var/log/ernie-deploy/audit.log").stdout
    assert '"action": "rollback"' in audit and '"action": "stop"' in audit


def test_failing_canary_stops_everything_after_one_host(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                        lab_state: LabState, fleet: Path, tmp_path: Path) -> None:
    others = {h.name: start_times(lab, h.name) for h in lab_state.hosts[1:]}
    faults(lab, "a10-1", {**QUICK, "when": {"max_model_len": 1280}, "fail_startup": "cuda_oom"})
    inv = inventory(lab_state, tmp_path, **{h.name: {"vllm_max_model_len": 1280} for h in lab_state.hosts})
    try:
        rc, doc = run(capsys, "deploy", "-i", str(inv), "--canary", "1", "--serial", "100%")
    finally:
        faults(lab, "a10-1", QUICK)
    assert rc == 2 and doc["rollout"]["batches"][0] == ["a10-1"]
    assert "first batch (canary)" in doc["rollout"]["stopped"]
    assert all(doc["by_host"][h]["status"] == "skipped" for h in others)
    assert {h: start_times(lab, h) for h in others} == others
    assert healthy("127.0.0.11:8000")


def test_failing_pre_drain_hook_stops_before_any_stop(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                      lab_state: LabState, fleet: Path) -> None:
    times = {h.name: start_times(lab, h.name) for h in lab_state.hosts}
    rc, doc = run(capsys, "restart", "-i", str(fleet), "--pre-drain", "echo 'balancer said no' >&2; exit 1")
    assert rc == 2 and "pre-drain hook exited 1" in doc["by_host"]["a10-1"]["message"]
    assert doc["by_host"]["a10-1"]["evidence"][0] == "balancer said no"
    assert {h.name: start_times(lab, h.name) for h in lab_state.hosts} == times


def test_rollout_refuses_to_start_on_top_of_an_outage_unless_forced(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                                    lab_state: LabState, fleet: Path) -> None:
    lab.ssh("a10-4", "systemctl stop ernie-vllm-0.service")
    times = start_times(lab, "a10-1")
    rc, doc = run(capsys, "restart", "-i", str(fleet))
    assert rc == 2 and doc["rollout"]["refused"] == ["a10-4 ernie-vllm-0.service: not running (inactive/dead)"]
    assert "already down: a10-4 ernie-vllm-0.service" in doc["by_host"]["a10-4"]["message"]
    assert start_times(lab, "a10-1") == times
    rc, doc = run(capsys, "restart", "-i", str(fleet), "--limit", "a10-4", "--force")
    assert rc == 0 and healthy("127.0.0.13:8000"), doc["by_host"]["a10-4"]["message"]


def test_process_holding_the_gpu_is_refused_before_the_stop_naming_it(capsys: pytest.CaptureFixture[str],
                                                                       lab: Lab, units: Units, fleet: Path) -> None:
    """A leaked vLLM EngineCore outside the instance's unit (vllm #55510: it survives its API server and keeps
    the GPU memory) holds GPU 0: stopped, the instance could not start again, so the pre-flight refuses the
    host before anything stops, naming the PID, its GPU and the fix; the instance keeps serving."""
    lab.ssh("a10-1", f"cat > {LEAK}", input=LEAK_PROGRAM)
    units.start("a10-1", "leaked", f"/usr/bin/python3 {LEAK}", extra="KillSignal=SIGKILL\n")
    assert wait_for(lambda: "VLLM::EngineCor" in lab.ssh("a10-1", "ps -e -o comm=").stdout, timeout=20)
    pids = {lab.ssh("a10-1", "systemctl show -p MainPID --value leaked.service").stdout.strip()}
    times = start_times(lab, "a10-1")
    capsys.readouterr()
    rc = main(["restart", "-i", str(fleet), "--limit", "a10-1", "--json", "--gpu-release-timeout", "3"])
    (host,) = json.loads(capsys.readouterr().out)["hosts"]
    holder = host["message"].split("PID ")[1].split(" ")[0] if "PID " in host["message"] else ""
    assert rc == 2 and holder in pids and "(VLLM::EngineCor)" in host["message"], host["message"]
    assert "refused before stopping anything" in host["message"] and "GPU 0" in host["message"]
    assert f"kill {holder}" in host["hint"]
    assert units.state("a10-1", "ernie-vllm-0") == "active" and start_times(lab, "a10-1") == times
    assert healthy("127.0.0.11:8000")
    units.cleanup()
    rc, doc = run(capsys, "restart", "-i", str(fleet), "--limit", "a10-1")
    assert rc == 0 and healthy("127.0.0.11:8000"), doc["by_host"]["a10-1"]["message"]


def test_a_process_holding_a_fresh_hosts_gpu_fails_its_first_start_naming_it(capsys: pytest.CaptureFixture[str],
                                                                          lab: Lab, units: Units, fleet: Path) -> None:
    """A host with nothing of ours on it, and a leaked EngineCore on its GPU: the GPU gate's first reading,
    taken by the stage's own command through the host's shell and the simulated nvidia-smi, names the PID, and
    the instance is not started (its staged files are taken back); freed, the same deploy starts it."""
    lab.ssh("a10-1", CLEAN)
    lab.ssh("a10-1", f"cat > {LEAK}", input=LEAK_PROGRAM)
    units.start("a10-1", "leaked", f"/usr/bin/python3 {LEAK}", extra="KillSignal=SIGKILL\n")
    assert wait_for(lambda: "VLLM::EngineCor" in lab.ssh("a10-1", "ps -e -o comm=").stdout, timeout=20)
    pid = lab.ssh("a10-1", "systemctl show -p MainPID --value leaked.service").stdout.strip()
    rc, doc = run(capsys, "deploy", "-i", str(fleet), "--limit", "a10-1", "--gpu-release-timeout", "2")
    host = doc["by_host"]["a10-1"]
    assert rc == 2 and f"PID {pid} (VLLM::EngineCor)" in host["message"], host["message"]
    assert "not free for the first start" in host["message"] and f"kill {pid}" in host["hint"]
    steps = [s["name"] for s in host["steps"]]
    assert steps.index("stage") < steps.index("gpu release ernie-vllm-0") and not any(
        s.startswith("start ") for s in steps), steps
    assert units.state("a10-1", "ernie-vllm-0") == "inactive"
    units.cleanup()
    rc, doc = run(capsys, "deploy", "-i", str(fleet), "--limit", "a10-1")
    assert rc == 0 and healthy("127.0.0.11:8000"), doc["by_host"]["a10-1"]["message"]


def sigterm_while_a10_1_loads(lab: Lab, fleet: Path, env: dict[str, str],
                              argv: list[str]) -> tuple[Path, int, dict[str, Any]]:
    """Run the restart `argv` and SIGTERM it while a10-1's restarted instance loads (its pre-drain hook ran,
    post-ready not yet): the restart's resume state file, its exit code and its JSON."""
    state = Path(env["ERNIE_DEPLOY_STATE_DIR"]) / f"{resume.key_of('restart', str(fleet.resolve()), None, None)}.json"
    state.unlink(missing_ok=True)  # an earlier scenario's stopped restart of the same scope
    before = start_times(lab, "a10-1")
    faults(lab, "a10-1", {"load_seconds": 8})  # a window between its start and its readiness
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: start_times(lab, "a10-1") != before, 60, interval=0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        faults(lab, "a10-1", QUICK)
    return state, proc.returncode, json.loads(out)


def test_sigterm_mid_restart_names_the_instance_out_of_rotation_and_resume_puts_it_back(
        lab: Lab, lab_state: LabState, fleet: Path, tmp_path: Path) -> None:
    """SIGTERM while a10-1's restarted instance loads (its pre-drain hook ran, post-ready not yet): the result
    names it out of the load balancer and the resume state keeps it; `--resume` runs post-ready once it serves
    and finishes the rollout. At the end every instance serves and is in rotation."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rotation = tmp_path / "rotation.json"
    everything = sorted(b for bs in backends(lab_state).values() for b in bs)
    rotation.write_text(json.dumps(everything))
    argv = [sys.executable, "-m", "ernie_deploy", "restart", "-i", str(fleet), "--json",
            "--pre-drain", hook(rotation, "remove"), "--post-ready", hook(rotation, "add")]
    state, returncode, doc = sigterm_while_a10_1_loads(lab, fleet, env, argv)
    first = {h["host"]: h for h in doc["hosts"]}["a10-1"]
    assert returncode != 0 and first["status"] == "failed", first["message"]
    assert doc["rollout"]["out_of_rotation"] == {"a10-1": ["ernie-vllm-0.service"]}
    assert [c["name"] for c in first["checks"] if c["status"] == "fail"] == ["rotation"]
    assert json.loads(state.read_text())["out"] == {"a10-1": ["ernie-vllm-0.service"]}
    assert "127.0.0.11:8000" not in json.loads(rotation.read_text())
    assert wait_for(lambda: all_healthy(lab_state), 60)
    resumed = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert json.loads(resumed.stdout)["rollout"]["out_of_rotation"] == {}
    assert sorted(json.loads(rotation.read_text())) == everything
    assert not state.exists() and all_healthy(lab_state)


def test_ctrl_c_after_the_first_batch_then_resume(lab: Lab, lab_state: LabState, fleet: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    state_dir = Path(env["ERNIE_DEPLOY_STATE_DIR"])
    before = {h.name: start_times(lab, h.name) for h in lab_state.hosts}
    state = state_dir / f"{resume.key_of('restart', str(fleet.resolve()), None, None)}.json"
    state.unlink(missing_ok=True)  # an earlier scenario's stopped restart of the same scope
    argv = [sys.executable, "-m", "ernie_deploy", "restart", "-i", str(fleet), "--serial", "1", "--json"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: batch_done(state), 60, interval=0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    first = json.loads(out)["hosts"][0]
    assert first["host"] == "a10-1" and first["status"] == "changed"
    done_first = start_times(lab, "a10-1")
    assert done_first != before["a10-1"]
    assert wait_for(lambda: all_healthy(lab_state), 60)
    resumed = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    doc = json.loads(resumed.stdout)
    assert doc["rollout"]["resumed"] and "done in batch 1" in doc["hosts"][0]["message"]
    assert start_times(lab, "a10-1") == done_first  # batch 1 not restarted again
    after = {h.name: start_times(lab, h.name) for h in lab_state.hosts[1:]}
    assert all(after[h] != before[h] for h in after)
    assert not state.exists()


def test_two_replicas_on_one_host_are_never_down_together(capsys: pytest.CaptureFixture[str], lab_state: LabState,
                                                          fleet: Path, tmp_path: Path) -> None:
    two = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}
    rc, doc = run(capsys, "deploy", "-i", str(inventory(lab_state, tmp_path, "two.yml", **{"a10-2": two})),
                  "--limit", "a10-2")
    assert rc == 0, doc["by_host"]["a10-2"]["message"]
    assert "as a whole" in doc["by_host"]["a10-2"]["message"]  # TP 2 → 2 × TP 1 moves GPUs
    sampler = Sampler({"a": ["127.0.0.12:8000"], "b": ["127.0.0.12:8001"]})
    sampler.start()
    try:
        changed = inventory(lab_state, tmp_path, "two-changed.yml", **{"a10-2": {**two, "vllm_max_model_len": 1536}})
        rc, doc = run(capsys, "deploy", "-i", str(changed), "--limit", "a10-2")
    finally:
        samples = sampler.finish()
    assert rc == 0, doc["by_host"]["a10-2"]["message"]
    assert "one at a time" in doc["by_host"]["a10-2"]["message"]
    assert any(down for _, down in samples)  # each was down for a while...
    assert sampler.most_hosts_down() == 1  # ...but never both at once
    rc, doc = run(capsys, "deploy", "-i", str(fleet), "--limit", "a10-2", "--prune")
    assert rc == 0, doc["by_host"]["a10-2"]["message"]


def test_rendered_tp2_unit_lets_an_in_flight_stream_finish_on_stop(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                                   fleet: Path) -> None:
    """The rendered unit (KillMode=mixed, --shutdown-timeout from vllm_drain_timeout): `systemctl stop` of a TP-2
    instance while a stream runs lets the stream finish (under KillMode=control-group its workers would die
    first: tests/lab/test_lab_vllm.py shows the stream cut there)."""
    assert "KillMode=mixed" in lab.ssh("a10-2", "cat /etc/systemd/system/ernie-vllm-0.service").stdout
    result: dict[str, tuple[bool, str]] = {}
    reader = threading.Thread(target=lambda: result.setdefault(
        "stream", complete("127.0.0.12:8000", "ERNIE-4.5-0.3B-PT", True, 400)))
    reader.start()
    time.sleep(0.5)
    lab.ssh("a10-2", "systemctl stop ernie-vllm-0.service")
    reader.join(timeout=60)
    ok, detail = result["stream"]
    assert ok, detail
    journal = lab.ssh("a10-2", "journalctl -u ernie-vllm-0 -o cat --no-pager -n 30").stdout
    assert "died unexpectedly" not in journal
    rc, doc = run(capsys, "deploy", "-i", str(fleet), "--limit", "a10-2")
    assert rc == 0, doc["by_host"]["a10-2"]["message"]


def test_a_host_that_freezes_mid_rollout_is_unreachable_within_the_host_timeout(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Path) -> None:
    """The last host of a rollout freezes whole (its container's cgroup frozen: sshd, vLLM and systemd stop,
    the kernel still holds the connection open) right after its pre-drain hook, while the drain reads its
    metrics over SSH. The run ends within --host-timeout with that host UNREACHABLE (exit 4), the host before it
    done, and its lock named as left behind. Before, the read waited 120 s and the lock release as long again."""
    *_, first, last = lab_state.hosts
    freeze = next(Path(d, "cgroup.freeze") for d in last.cgroups if Path(d, "cgroup.freeze").exists())
    limit = f"{first.name},{last.name}"
    key = resume.key_of("restart", str(fleet.resolve()), limit, None)
    state = Path(os.environ["ERNIE_DEPLOY_STATE_DIR"]) / f"{key}.json"
    before = start_times(lab, first.name)
    hook_text = f'if [ "$ERNIE_HOST" = {last.name} ]; then echo 1 > {freeze}; fi'
    started = time.monotonic()
    try:
        rc, doc = run(capsys, "restart", "-i", str(fleet), "--limit", limit, "--serial", "1",
                      "--pre-drain", hook_text, "--host-timeout", "5")
        took = time.monotonic() - started
    finally:
        freeze.write_text("0")
    frozen, done = doc["by_host"][last.name], doc["by_host"][first.name]
    assert rc == 4 and frozen["status"] == "unreachable", frozen["message"]
    assert "answered nothing for 5s" in frozen["message"] and took < 60, (frozen["message"], took)
    assert done["status"] in ("ok", "changed") and start_times(lab, first.name) != before, done["message"]
    assert any(f"could not release the deploy lock on {last.name}: host not answering" in e
               for e in frozen["evidence"]), frozen["evidence"]
    lab.ssh(last.name, "rm -rf /var/lib/ernie-deploy/lock")  # the lock the frozen run could not release
    state.unlink(missing_ok=True)
    assert wait_for(lambda: all_healthy(lab_state), 60)  # never stopped: it serves again once thawed


@pytest.fixture
def haproxy(lab_state: LabState, tmp_path: Path) -> Iterator[HAProxy]:
    """A real HAProxy in front of the fleet's instances (one per host, port 8000), servers named as docs/hooks.md
    says; the hook is docs/hooks.md's own script pointed at its socket."""
    with running(tmp_path / "haproxy", {f"{h.name}-0": f"{h.address}:8000" for h in lab_state.hosts}) as proxy:
        yield proxy


def all_up(proxy: HAProxy) -> bool:
    """Every server READY and passing its checks: not DRAIN or MAINT (out of rotation), not DOWN."""
    return set(proxy.states().values()) == {"UP"}


def drained_then_ready(proxy: HAProxy, server: str) -> bool:
    """HAProxy's log has the hook's drain of `server` and, after its last drain, the hook's `state ready`
    ("leaving forced drain": logged as "is UP (...)" or, before its checks see it again, "is DOWN (...)")."""
    events = proxy.events(server)
    drains = [i for i, e in enumerate(events) if e.startswith("enters drain state")]
    return bool(drains) and any("(leaving forced drain)" in e for e in events[drains[-1]:])


def test_haproxy_rollout_with_a_start_failure_rolled_back_loses_no_request_and_ends_in_rotation(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Path, haproxy: HAProxy,
        tmp_path: Path) -> None:
    """Issue 23's "Done when" with a real HAProxy: a rolling deploy under load through HAProxy, with the docs'
    hook as pre-drain and post-ready. vLLM's CUDA OOM hits a10-2's new release (batch 2) and is rolled back.
    At the end HAProxy itself has every server UP (none left in DRAIN), it never got a connection or response
    error from an instance, and no client request failed."""
    hook = f"sh {hook_script(tmp_path, haproxy.socket)}"
    # The load generator sends every request to its one "backend", HAProxy's frontend: HAProxy balances.
    frontend = tmp_path / "frontend.json"
    frontend.write_text(json.dumps([haproxy.frontend]))
    lb = LoadBalancer(frontend, "ERNIE-4.5-0.3B-PT")
    # 1408, not 1536: a10-2's release with 1536 is marked failed by the rollback scenario above.
    faults(lab, "a10-2", {**QUICK, "when": {"max_model_len": 1408}, "fail_startup": "cuda_oom"})
    inv = inventory(lab_state, tmp_path, **{h.name: {"vllm_max_model_len": 1408} for h in lab_state.hosts})
    lb.start()
    try:
        time.sleep(1.0)
        rc, doc = run(capsys, "deploy", "-i", str(inv), "--serial", "1", "--pre-drain", hook, "--post-ready", hook)
        time.sleep(1.0)
    finally:
        outcomes = lb.finish()
        faults(lab, "a10-2", QUICK)
    hosts = doc["by_host"]
    assert rc == 2 and hosts["a10-1"]["status"] == "changed" and hosts["a10-2"]["status"] == "failed", \
        [(h["host"], h["message"]) for h in doc["hosts"]]
    assert any("rolled back to release" in x for x in hosts["a10-2"]["rollbacks"]), hosts["a10-2"]["rollbacks"]
    assert doc["rollout"]["out_of_rotation"] == {}
    # HAProxy's checks need a second or two to see a restarted instance UP again.
    wait_for(lambda: all_up(haproxy), 15)
    stats = haproxy.stats()
    assert all_up(haproxy), stats
    assert all_healthy(lab_state)
    # The hook drained exactly the instances the rollout stopped, and set each ready again.
    for server in ("a10-1-0", "a10-2-0"):
        assert drained_then_ready(haproxy, server), haproxy.events(server)
    for server in ("a10-4-0", "a100-2-0"):  # the rollout stopped before them: never drained
        assert not [e for e in haproxy.events(server) if "drain" in e], haproxy.events(server)
    # HAProxy never sent a request to a stopping or stopped instance, and no client saw a failure.
    assert all(s.econ == 0 and s.eresp == 0 for s in stats.values()), stats
    lost = [o for o in outcomes if not o.ok]
    with capsys.disabled():  # the numbers, for a run with -rP or -s
        print(f"\nHAProxy rollout: {len(outcomes)} requests ({sum(o.stream for o in outcomes)} streamed), "
              f"{len(lost)} failed; per server (requests, errors): "
              f"{ {n: (s.stot, s.econ + s.eresp) for n, s in stats.items()} }")
    assert len(outcomes) > 50 and not lost, lost[:5]

    # a10-1 back on its base release for the scenarios after this one, through the same hooks.
    rc, doc = run(capsys, "deploy", "-i", str(fleet), "--limit", "a10-1", "--pre-drain", hook, "--post-ready", hook)
    assert rc == 0, doc["by_host"]["a10-1"]["message"]
    assert wait_for(lambda: all_up(haproxy), 15), haproxy.stats()


def test_haproxy_sigterm_mid_restart_leaves_the_instance_drained_and_resume_sets_it_ready(
        lab: Lab, lab_state: LabState, fleet: Path, haproxy: HAProxy, tmp_path: Path) -> None:
    """SIGTERM to the controller while a10-1's restarted instance loads: the result names it out of rotation and
    HAProxy still has it in DRAIN once it serves (nothing silently put back, nothing silently left out);
    `--resume` runs post-ready for it and finishes the rollout: HAProxy has every server UP."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hook = f"sh {hook_script(tmp_path, haproxy.socket)}"
    argv = [sys.executable, "-m", "ernie_deploy", "restart", "-i", str(fleet), "--serial", "1", "--json",
            "--pre-drain", hook, "--post-ready", hook]
    state, returncode, doc = sigterm_while_a10_1_loads(lab, fleet, env, argv)
    assert returncode != 0 and doc["rollout"]["out_of_rotation"] == {"a10-1": ["ernie-vllm-0.service"]}, doc
    assert wait_for(lambda: all_healthy(lab_state), 60)
    # Serving again, and HAProxy's checks pass, but the balancer keeps it out until post-ready says otherwise.
    assert wait_for(lambda: haproxy.states()["a10-1-0"] == "DRAIN", 15), haproxy.stats()
    assert {s: v for s, v in haproxy.states().items() if s != "a10-1-0"} == \
        {f"{h.name}-0": "UP" for h in lab_state.hosts[1:]}
    resumed = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert json.loads(resumed.stdout)["rollout"]["out_of_rotation"] == {}
    assert wait_for(lambda: all_up(haproxy), 15), haproxy.stats()
    assert drained_then_ready(haproxy, "a10-1-0"), haproxy.events("a10-1-0")
    assert not state.exists() and all_healthy(lab_state)
