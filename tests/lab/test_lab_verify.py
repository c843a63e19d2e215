"""Post-deploy verification against the lab (issue: readiness, smoke test, log keywords, GPU balance)."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import Units, clean, wait_for
from lab.test_lab_deploy import write_inventory

pytestmark = pytest.mark.lab

PLANNED_TP = {"a10-1": 1, "a10-2": 2, "a10-4": 4, "a100-2": 2}
FAULTS = "/etc/ernie-lab/faults.json"


@pytest.fixture(scope="module")
def verified(lab: Lab, lab_state: LabState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    clean(lab, lab_state)
    inv = write_inventory(lab_state, tmp_path_factory.mktemp("verify"))
    assert main(["deploy", "-i", str(inv), "--startup-budget", "60"]) == 0
    try:
        yield inv
    finally:
        for h in lab_state.hosts:
            lab.ssh(h.name, f"rm -f {FAULTS}")
        clean(lab, lab_state)


def run(capsys: pytest.CaptureFixture[str], command: str, inv: Path, *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([command, "-i", str(inv), "--json", *args])
    return rc, {h["host"]: h for h in json.loads(capsys.readouterr().out)["hosts"]}


def checks(host: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [c for c in host["checks"] if c["name"] == name]


def test_healthy_lab_passes_every_check_and_shows_the_tp(capsys: pytest.CaptureFixture[str], verified: Path,
                                                         tmp_path: Path) -> None:
    junit = tmp_path / "verify.xml"
    rc, hosts = run(capsys, "verify", verified, "--junit", str(junit))
    assert rc == 0, {h: [c for c in r["checks"] if c["status"] != "pass"] for h, r in hosts.items()}
    for name, tp in PLANNED_TP.items():
        (tp_check,) = checks(hosts[name], "tensor_parallel")
        # The phrase operators search for, with the evidence it stands on (vLLM never prints the phrase itself).
        assert tp_check["summary"].startswith(f"Using tensor parallel size {tp} ✓ (vLLM's engine config says "
                                              f"tensor_parallel_size={tp}")
        assert any(f"tensor_parallel_size={tp}" in line for line in tp_check["evidence"])
        assert {c["status"] for c in hosts[name]["checks"]} <= {"pass", "warn"}
        for wanted in ("systemd", "max_model_len", "http_health", "http_models", "http_completion",
                       "gpu_memory_balance", "gpus_in_use", "gpu_foreign_processes"):
            assert checks(hosts[name], wanted), (name, wanted)
    suites = ET.parse(junit).getroot()
    assert int(suites.get("failures", "0") or 0) == 0 and len(suites.findall(".//testcase")) > 20
    capsys.readouterr()
    assert main(["verify", "-i", str(verified), "--limit", "a10-4"]) == 0
    assert "Using tensor parallel size 4 ✓" not in capsys.readouterr().out  # a passing check is -v detail
    assert main(["verify", "-i", str(verified), "--limit", "a10-4", "-v"]) == 0
    assert "Using tensor parallel size 4 ✓" in capsys.readouterr().out


def test_playbook_expect_forbid_and_streaming(capsys: pytest.CaptureFixture[str], verified: Path,
                                              tmp_path: Path) -> None:
    from conftest import ROOT

    rc, hosts = run(capsys, "verify", verified, "--limit", "a10-2", "--playbook", str(ROOT / "playbooks/verify.yml"))
    assert rc == 0, hosts["a10-2"]["checks"]
    names = {c["name"]: c for c in hosts["a10-2"]["checks"]}
    assert names["expect Using max model len {max_model_len}"]["status"] == "pass"
    assert "(first byte" in names["http_completion"]["summary"]
    strict = tmp_path / "strict.yml"
    strict.write_text('- hosts: all\n  tasks:\n    - verify:\n        forbid: ["Using max model len {max_model_len}"]\n'
                      '        expect: ["no such line"]\n')
    rc, hosts = run(capsys, "verify", verified, "--limit", "a10-2", "--playbook", str(strict))
    failed = {c["name"] for c in hosts["a10-2"]["checks"] if c["status"] == "fail"}
    assert rc == 2 and failed == {"forbid Using max model len {max_model_len}", "expect no such line"}


def test_hand_edited_tp_is_caught_with_both_numbers_and_idle_gpu(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                                 verified: Path) -> None:
    lab.ssh("a10-2", "sed -i 's/--tensor-parallel-size 2/--tensor-parallel-size 1/' "
                     "/etc/systemd/system/ernie-vllm-0.service && systemctl daemon-reload && "
                     "systemctl restart ernie-vllm-0.service")
    assert wait_for(lambda: "Application startup complete." in lab.ssh(
        "a10-2", "journalctl -u ernie-vllm-0 -n 5 -o cat --no-pager").stdout, timeout=30)
    rc, hosts = run(capsys, "verify", verified, "--limit", "a10-2")
    assert rc == 2
    (tp,) = checks(hosts["a10-2"], "tensor_parallel")
    assert tp["status"] == "fail" and "plan says TP 2, vLLM uses TP 1" in tp["summary"]
    (in_use,) = checks(hosts["a10-2"], "gpus_in_use")
    assert in_use["status"] == "fail"  # TP 1 leaves the second GPU of the group idle
    rc, hosts = run(capsys, "deploy", verified, "--limit", "a10-2")  # converge puts the planned unit back
    assert rc == 0 and hosts["a10-2"]["restarted"] == ["ernie-vllm-0.service"]


def test_foreign_process_on_an_instances_gpu(capsys: pytest.CaptureFixture[str], units: Units, lab_state: LabState,
                                            verified: Path, tmp_path: Path) -> None:
    # Leave room on the GPUs, then let another vLLM squat on the instance's last GPU.
    roomy = write_inventory(lab_state, tmp_path, **{"a10-4": {"vllm_gpu_memory_utilization": 0.5}})
    assert run(capsys, "deploy", roomy, "--limit", "a10-4")[0] == 0
    units.start("a10-4", "intruder", "/opt/vllm/0.34.0/bin/vllm serve /models/ERNIE-4.5-0.3B-PT --host 127.0.0.13 "
                "--port 8100 --gpu-memory-utilization 0.3 --max-model-len 1024",
                env={"CUDA_VISIBLE_DEVICES": "3", "VLLM_SIM_LOAD_SECONDS": "0.5"})
    assert units.wait_state("a10-4", "intruder", "active") == "active"
    assert wait_for(lambda: "Application startup complete." in units.journal("a10-4", "intruder"), timeout=30)
    rc, hosts = run(capsys, "verify", roomy, "--limit", "a10-4")
    assert rc == 2
    (foreign,) = checks(hosts["a10-4"], "gpu_foreign_processes")
    assert foreign["status"] == "fail", foreign
    # The squatter's memory also unbalances the group; nothing else may fail.
    assert {c["name"] for c in hosts["a10-4"]["checks"] if c["status"] == "fail"} <= {
        "gpu_foreign_processes", "gpu_memory_balance"}


@pytest.mark.parametrize(("fault", "headline"), [
    ("attention_heads", "must be divisible by tensor parallel size"),
    ("max_model_len", "User-specified max_model_len"),
    ("world_size", "is larger than the number of available GPUs"),
    ("kv_cache", "which is larger than the available KV cache memory"),
    ("free_memory", "Free memory on device"),
    ("architecture", "are not supported for now"),
    ("cuda_oom", "CUDA out of memory"),
    ("address_in_use", "Address already in use"),
    ("nccl", "NCCL"),
    ("expert_parallel", "Number of experts in the model must be greater than 0"),
    ("traceback", ""),
])
def test_startup_failure_is_reported_within_two_seconds(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                        lab_state: LabState, verified: Path, tmp_path: Path,
                                                        fault: str, headline: str) -> None:
    # The fault hits only the new release (its changed context length), so the rollback can succeed.
    new_len = 1000 + len(fault)
    lab.ssh("a10-1", f"cat > {FAULTS}", input=json.dumps({"fail_startup": fault, "when": {"max_model_len": new_len}}))
    # A changed context length forces a restart; the 10-minute budget must not be what ends the wait.
    inv = write_inventory(lab_state, tmp_path, **{"a10-1": {"vllm_max_model_len": new_len}})
    t0 = time.time()
    rc, hosts = run(capsys, "deploy", inv, "--limit", "a10-1", "--startup-budget", "600")
    lab.ssh("a10-1", f"rm -f {FAULTS}")
    r = hosts["a10-1"]
    assert rc == 2 and r["status"] == "failed", r
    assert headline in r["message"], r["message"]
    assert r["hint"] and r["evidence"]
    # The previous release runs again, verified.
    assert any("rolled back to release" in x and "ready and verified" in x for x in r["rollbacks"]), r["rollbacks"]
    (ready,) = [s for s in r["steps"] if s["name"] == "ready ernie-vllm-0" and s["status"] == "failed"]
    returned = ready["ended_at"]
    # When did the fatal line reach the journal? (journal clock = this machine's clock: containers share it)
    out = lab.ssh("a10-1", f"journalctl -u ernie-vllm-0 -o short-unix --no-pager --since=@{t0:.6f}").stdout
    pattern = headline or "Traceback (most recent call last)"
    stamps = [float(line.split()[0]) for line in out.splitlines() if pattern in line and line[:1].isdigit()]
    assert stamps, out[-2000:]
    assert returned - stamps[0] < 2.0, f"reported {returned - stamps[0]:.2f}s after the line appeared"


def test_hung_load_times_out_at_the_budget_with_journal_lines(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                              lab_state: LabState, verified: Path,
                                                              tmp_path: Path) -> None:
    lab.ssh("a10-1", f"cat > {FAULTS}", input=json.dumps({"hang_loading": True, "when": {"max_model_len": 2222}}))
    inv = write_inventory(lab_state, tmp_path, **{"a10-1": {"vllm_max_model_len": 2222}})
    rc, hosts = run(capsys, "deploy", inv, "--limit", "a10-1", "--startup-budget", "8")
    lab.ssh("a10-1", f"rm -f {FAULTS}")
    r = hosts["a10-1"]
    assert rc == 2 and "not ready within the start-up budget of 8s" in r["message"]
    (ready,) = [s for s in r["steps"] if s["name"] == "ready ernie-vllm-0" and s["status"] == "failed"]
    assert 8 <= ready["seconds"] < 12
    assert any("rolled back to release" in x and "ready and verified" in x for x in r["rollbacks"]), r["rollbacks"]
    # The last lines of a hung load: 0.34 logs "Loading model from scratch...", older releases "Starting to load".
    assert any("Loading model from scratch" in line or "Starting to load model" in line
               for line in r["evidence"]), r["evidence"]


def test_crash_loop_is_named(capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, verified: Path,
                             tmp_path: Path) -> None:
    lab.ssh("a10-1", f"cat > {FAULTS}", input=json.dumps({"crash_after_s": 0.5, "load_seconds": 0.5}))
    # Each revived process lives ~2 s here: a 10 s stability window makes its restarts recent, not history.
    inv = write_inventory(lab_state, tmp_path, **{"a10-1": {"vllm_max_model_len": 3333, "vllm_stable_seconds": 10}})
    # The failed state itself is under test: keep it (no rollback).
    rc, hosts = run(capsys, "deploy", inv, "--limit", "a10-1", "--startup-budget", "600", "--no-rollback")
    assert rc == 2 and hosts["a10-1"]["status"] == "failed"
    # systemd revives it every RestartSec (10 s); after two revivals it is a loop.
    assert wait_for(lambda: int(lab.ssh("a10-1", "systemctl show -p NRestarts --value ernie-vllm-0").stdout.strip()
                                or 0) >= 2, timeout=60, interval=1)
    rc, hosts = run(capsys, "verify", inv, "--limit", "a10-1")
    lab.ssh("a10-1", f"rm -f {FAULTS}")
    (systemd,) = checks(hosts["a10-1"], "systemd")
    assert rc == 2 and systemd["status"] == "fail" and "crash loop" in systemd["summary"]
