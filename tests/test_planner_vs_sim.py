"""The planner and the vLLM simulator are written independently; here they must agree.

Each case is planned and rendered, then the rendered unit's ExecStart (as systemd would split it) is run
against the simulator with the planned CUDA_VISIBLE_DEVICES. A plan with an error must fail in the
simulator with the same vLLM text; a clean plan must start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, ROOT
from systemd_words import unsystemd

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.render import environment_for_templates, render_host, templates_dir

SIM = ["-m", "ernie_deploy.lab.sim.vllm_sim"]
CONFIG = ROOT / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(tmp: Path, gpus: int, config: Path = CONFIG, **host_vars: object) -> tuple[object, str, int | None]:
    """Plan → render → run ExecStart on the simulator. Returns (plan, simulator log, exit code or None)."""
    model = tmp / "models" / "ERNIE-4.5-0.3B-PT"
    model.mkdir(parents=True)
    shutil.copy(config, model / "config.json")
    gpu_list = [{"index": i, "name": "NVIDIA A10", "uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000",
                 "memory_total_mib": 23028, "pci_bus_id": f"00000000:00:{0x1B + i:02X}.0"} for i in range(gpus)]
    (tmp / "etc/ernie-lab").mkdir(parents=True)
    (tmp / "etc/ernie-lab/gpus.json").write_text(json.dumps(
        {"driver_version": "550.127.05", "cuda_version": "12.4", "nvlink": False, "gpus": gpu_list}))
    if "vllm_version" in host_vars:
        (tmp / "etc/ernie-lab/vllm_version").write_text(f"{host_vars['vllm_version']}\n")
    inv = tmp / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"h": {
        "gpu_model": "NVIDIA A10", "gpu_count": gpus, "vllm_model": str(model), "vllm_model_config": str(model),
        "vllm_host": "127.0.0.1", "vllm_port": free_port(), "vllm_allow_fallback": True, **host_vars}}}}))
    (plan,) = plan_hosts(list(load_inventory(inv).select(None)), PlanContext.load())
    # Render even an erroneous plan's command line: the simulator must refuse what the planner refuses.
    ok_plan = plan
    if not plan.ok:
        from dataclasses import replace

        ok_plan = replace(plan, findings=())
    env_t = environment_for_templates(templates_dir())
    unit = render_host(ok_plan, env_t)[0].content
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = unsystemd(exec_line.removeprefix("ExecStart="))
    cuda = next(line for line in unit.splitlines() if line.startswith("Environment=CUDA_VISIBLE_DEVICES="))
    env = {**os.environ, "ERNIE_LAB_ROOT": str(tmp), "VLLM_SIM_LOAD_SECONDS": "0.2",
           "CUDA_VISIBLE_DEVICES": cuda.split("=", 2)[2]}
    log = tmp / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *SIM, *argv[1:]], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None or "Application startup complete." in log.read_text():
                break
            time.sleep(0.05)
        code = proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return plan, log.read_text(), code


CASES = {
    # name: (gpus, host vars, planner finding code or None)
    "guide-1xA10": (1, {}, None),
    "guide-2xA10": (2, {}, None),
    "guide-4xA10": (4, {}, None),
    "guide-8192-tp1-one-a10": (1, {"vllm_max_model_len": 8192}, None),
    "tp3": (4, {"vllm_tensor_parallel_size": 3}, "tp-heads"),
    "max-len-above-derived": (1, {"vllm_max_model_len": 200000}, "max-model-len"),
    "max-len-above-derived-0.11": (1, {"vllm_max_model_len": 200000, "vllm_version": "0.11.0"}, "max-model-len"),
    "world-size": (2, {"vllm_tensor_parallel_size": 4, "vllm_instances": 1}, "world-size"),
    "kv-too-small": (1, {"vllm_max_model_len": 131072, "vllm_gpu_memory_utilization": 0.1}, "kv-too-small"),
    "kv-too-small-0.11": (1, {"vllm_max_model_len": 131072, "vllm_gpu_memory_utilization": 0.1,
                              "vllm_version": "0.11.0"}, "kv-too-small"),
    "ep-dense": (2, {"vllm_extra_args": ["--enable-expert-parallel"]}, "ep-dense"),
    "removed-flag": (1, {"vllm_extra_args": ["--swap-space", "4"]}, "removed-flag"),
    "old-flag-ok-on-0.11": (1, {"vllm_extra_args": ["--swap-space", "4"], "vllm_version": "0.11.0"}, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_planner_and_simulator_agree(tmp_path: Path, name: str) -> None:
    gpus, host_vars, code = CASES[name]
    plan, log, exit_code = run_case(tmp_path, gpus, **host_vars)
    if code is None:
        assert plan.ok, plan.findings  # type: ignore[attr-defined]
        assert exit_code is None and "Application startup complete." in log, log[-2000:]
        return
    finding = next(f for f in plan.findings if f.code == code)  # type: ignore[attr-defined]
    assert exit_code not in (None, 0), f"simulator started although the planner says {finding.message}"
    expected = finding.vllm_message or ""
    # Compare the part of the message both can know: the prefix up to the numbers vLLM measures at runtime.
    # Log lines carry a process prefix, so a multi-line message is compared by its first line.
    stable = expected.split(", (")[0] if code == "kv-too-small" else expected.split(" Supported architectures")[0]
    stable = stable.splitlines()[0]
    assert stable and stable in log, f"planner: {expected!r}\nsimulator log tail:\n{log[-1500:]}"


@pytest.mark.parametrize(("version", "code"), [("0.34.0", "architecture"), ("0.9.2", None)])
def test_architecture_rename_agrees(tmp_path: Path, version: str, code: str | None) -> None:
    plan, log, exit_code = run_case(tmp_path, 1, config=FIXTURES / "models/ernie-0.3b-pre-rename.json",
                                    vllm_version=version)
    if code is None:
        assert plan.ok and exit_code is None  # type: ignore[attr-defined]
        assert "Resolved architecture: Ernie4_5_ForCausalLM" in log
        return
    finding = next(f for f in plan.findings if f.code == code)  # type: ignore[attr-defined]
    assert exit_code not in (None, 0)
    assert (finding.vllm_message or "").split(" Supported architectures")[0] in log


def test_weights_larger_than_the_gpu_fail_at_load_in_both(tmp_path: Path) -> None:
    """ERNIE-4.5-21B on one A10: the planner names vLLM's load-time CUDA OOM (not the KV-cache error), and the
    simulator fails with it while loading, before any KV-cache line."""
    moe = ROOT / "ernie_deploy/data/models/ERNIE-4.5-21B-A3B-PT/config.json"
    plan, log, exit_code = run_case(tmp_path, 1, config=moe)
    finding = next(f for f in plan.findings if f.code == "weights-exceed-gpu")  # type: ignore[attr-defined]
    assert exit_code not in (None, 0)
    assert (finding.vllm_message or "") in log
    assert "Available KV cache memory" not in log and "No available memory for the cache blocks" not in log
