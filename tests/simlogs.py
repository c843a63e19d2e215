"""Recorded runs of the simulated `vllm serve`: the scenarios behind tests/fixtures/logs/sim/ and the format test.

Each scenario runs the simulator (`python -m ernie_deploy.lab.sim.vllm_sim`) in its own temporary
ERNIE_LAB_ROOT with 4 simulated A10s, the model at `<root>/opt/models/ERNIE-4.5-0.3B-PT` and a free port, and
returns stdout and stderr interleaved as the journal shows them. `normalise` then turns the root and port into
`/opt/models/...` and 8000.

Regenerate the committed simulator fixtures (the sim README's recipe) with

    .venv/bin/python tests/simlogs.py
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIM_DIR = REPO / "tests" / "fixtures" / "logs" / "sim"
MODEL_DIR = "/opt/models/ERNIE-4.5-0.3B-PT"
ERNIE_CONFIG: dict[str, Any] = json.loads((REPO / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json").read_text())
CONFIGS: dict[str, dict[str, Any]] = {
    "ernie": ERNIE_CONFIG,
    "pre-rename": {**ERNIE_CONFIG, "architectures": ["Ernie4_5_ForCausalLM"]},
    "no-max-len": {k: v for k, v in ERNIE_CONFIG.items() if k != "max_position_embeddings"},
    "heads-12": {**ERNIE_CONFIG, "num_attention_heads": 12},
    "moe": {**ERNIE_CONFIG, "architectures": ["Ernie4_5_MoeForCausalLM"], "moe_num_experts": 2,
            "moe_intermediate_size": 512},
}
LOAD_SECONDS = "0.3"
TIMEOUT = 30.0


@dataclass(frozen=True)
class Scenario:
    """One `vllm serve` run. `drive`: "fail" (wait for the exit), "serve" (ready, two requests, SIGTERM),
    "ready" (ready, then SIGKILL: the start-up only), "crash" (ready, wait for the crash_after_s exit),
    "interrupt" (SIGTERM while the weights load, with hang_loading)."""

    version: str
    flags: tuple[str, ...] = ("--tensor-parallel-size", "2")
    faults: dict[str, Any] = field(default_factory=dict)
    drive: str = "fail"
    config: str = "ernie"
    env: tuple[tuple[str, str], ...] = ()
    nvlink: bool = False

    def argv(self, model: str, port: int) -> list[str]:
        return [sys.executable, "-m", "ernie_deploy.lab.sim.vllm_sim", "serve", model, "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", "ernie", *self.flags]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _setup(root: Path, sc: Scenario) -> Path:
    gpus = [{"index": i, "name": "NVIDIA A10", "uuid": f"GPU-0000000{i}-1111-2222-3333-444444444444",
             "memory_total_mib": 23028, "pci_bus_id": f"00000000:00:{0x1B + i:02X}.0"} for i in range(4)]
    etc = root / "etc/ernie-lab"
    etc.mkdir(parents=True)
    (etc / "gpus.json").write_text(json.dumps({"driver_version": "550.127.05", "cuda_version": "12.4",
                                               "nvlink": sc.nvlink, "gpus": gpus}))
    (etc / "vllm_version").write_text(sc.version + "\n")
    if sc.faults:
        (etc / "faults.json").write_text(json.dumps(sc.faults))
    model = root / MODEL_DIR.lstrip("/")
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(CONFIGS[sc.config]))
    return model


def _wait_for(path: Path, proc: subprocess.Popen[bytes], text: str, deadline: float) -> bool:
    while time.monotonic() < deadline and proc.poll() is None:
        if text in path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def _get(port: int, path: str) -> None:
    with contextlib.suppress(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).close()


def _drive(sc: Scenario, proc: subprocess.Popen[bytes], log: Path, root: Path, port: int, deadline: float) -> None:
    if sc.drive == "fail":
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return
    if sc.drive == "interrupt":
        entry = root / f"run/ernie-lab/gpu/vllm-{proc.pid}.json"  # written just before the weights load
        while not entry.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return
    if not _wait_for(log, proc, "Application startup complete.", deadline):
        raise AssertionError(f"{sc}: never ready:\n{log.read_text()}")
    if sc.drive == "ready":
        return
    if sc.drive == "crash":
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return
    _get(port, "/health")
    _get(port, "/v1/models")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=max(0.1, deadline - time.monotonic()))


def sim_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a simulator under `root`: no GPU or key of the caller's, short loads."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "VLLM_API_KEY")}
    env.update({"ERNIE_LAB_ROOT": str(root), "VLLM_SIM_LOAD_SECONDS": LOAD_SECONDS, "PYTHONPATH": str(REPO),
                **(extra or {})})
    return env


def run(sc: Scenario) -> tuple[str, Path, int]:
    """(combined output, temporary root, port) of one scenario; every process it started is gone after."""
    with tempfile.TemporaryDirectory(prefix="simlog-") as tmp:
        root = Path(tmp)
        model = _setup(root, sc)
        port = _free_port()
        log = root / "out.log"
        env = sim_env(root, dict(sc.env))
        with open(log, "wb") as out:
            proc = subprocess.Popen(sc.argv(str(model), port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO)
        try:
            _drive(sc, proc, log, root, port, time.monotonic() + TIMEOUT)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return log.read_text(errors="replace"), root, port


def normalise(text: str, root: Path, port: int) -> str:
    return text.replace(str(root), "").replace(f":{port}", ":8000").replace(f"'port': {port}", "'port': 8000")


def run_all(scenarios: dict[str, Scenario], workers: int = 8) -> dict[str, str]:
    """Normalised output of every scenario, run in parallel (each has its own root, so GPUs never clash)."""

    def one(name: str) -> tuple[str, str]:
        try:
            text, root, port = run(scenarios[name])
        except (AssertionError, subprocess.TimeoutExpired) as err:
            return name, f"RUN FAILED: {err}"
        return name, normalise(text, root, port)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, scenarios))


# --- the committed fixtures (tests/fixtures/logs/sim/) --------------------------------------------------

FIXTURE_FAULTS = ("address_in_use", "architecture", "attention_heads", "cuda_oom", "expert_parallel",
                  "free_memory", "kv_cache", "nccl", "traceback", "world_size")


def fixture_scenarios() -> dict[str, tuple[Scenario, str]]:
    """File name -> (scenario, what the header says was run)."""
    out: dict[str, tuple[Scenario, str]] = {}
    tp2 = "vllm serve --tensor-parallel-size 2"
    for version in ("0.11.0", "0.34.0"):
        for fault in FIXTURE_FAULTS:
            knob = {"fail_startup": fault}
            out[f"fault-{version}-{fault}.log"] = (Scenario(version, faults=knob),
                                                   f"{tp2} with faults.json {json.dumps(knob)}")
    out["fault-0.34.0-max_model_len.log"] = (
        Scenario("0.34.0", ("--tensor-parallel-size", "2", "--max-model-len", "200000")),
        f"{tp2} --max-model-len 200000 (no fault knob)")
    out["fault-0.34.0-unknown_flag.log"] = (
        Scenario("0.34.0", ("--tensor-parallel-size", "2", "--swap-space", "4")),
        f"{tp2} --swap-space 4 (flag removed in 0.20)")
    for version, tp in (("0.11.0", 1), ("0.11.0", 2), ("0.34.0", 2)):
        out[f"healthy-{version}-tp{tp}.log"] = (
            Scenario(version, ("--tensor-parallel-size", str(tp)), drive="ready"),
            f"vllm serve --tensor-parallel-size {tp} (healthy start-up)")
    out["healthy-0.34.0-tp4.log"] = (
        Scenario("0.34.0", ("--tensor-parallel-size", "4", "--max-model-len", "4096"), drive="ready"),
        "vllm serve --tensor-parallel-size 4 --max-model-len 4096 (healthy start-up)")
    out["healthy-0.9.2-tp2.log"] = (
        Scenario("0.9.2", ("--tensor-parallel-size", "2"), drive="ready", config="pre-rename"),
        "vllm serve --tensor-parallel-size 2, pre-rename config (healthy start-up)")
    return out


def fixture_text(scenario: Scenario, what: str, output: str) -> str:
    """Header comment plus the output; a healthy start-up ends at uvicorn's `Application startup complete.`."""
    lines = output.splitlines()
    if scenario.drive == "ready":
        end = next(i for i, line in enumerate(lines) if line.endswith("Application startup complete."))
        lines = lines[:end + 1]
    header = [
        "# SIMULATOR OUTPUT (ernie_deploy/lab/sim/vllm_sim.py), not real vLLM: claimed version "
        f"{scenario.version}, 4 simulated A10s,",
        f"# {what}. Paths and ports normalised. Regenerate with the sim README recipe.",
    ]
    return "\n".join(header + lines) + "\n"


def regenerate() -> list[Path]:
    fixtures = fixture_scenarios()
    outputs = run_all({name: sc for name, (sc, _) in fixtures.items()})
    written = []
    for name, (sc, what) in fixtures.items():
        path = SIM_DIR / name
        path.write_text(fixture_text(sc, what, outputs[name]))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in regenerate():
        print(path.relative_to(REPO))
