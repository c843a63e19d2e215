"""Hand-written systemd units run the simulated `vllm serve` on lab hosts, as real deployments will.

The simulator (ernie_deploy/lab/sim/) must print vLLM's exact texts; these tests hold it to that through
systemd and journald, and check health, draining and GPU memory accounting from this machine.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from ernie_deploy.lab import Lab
from lab.labhelpers import Units, wait_for

pytestmark = pytest.mark.lab

VLLM = "/opt/vllm/0.34.0/bin/vllm serve /models/ERNIE-4.5-0.3B-PT"


def health(address: str, port: int) -> int | None:
    """HTTP status of /health, or None while nothing accepts connections."""
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/health", timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_unit_becomes_active_and_healthy_after_loading(units: Units) -> None:
    units.start("a10-2", "vllm-tp2",
                f"{VLLM} --tensor-parallel-size 2 --max-model-len 4096 --port 8000 --host 127.0.0.12",
                env={"VLLM_SIM_LOAD_SECONDS": "3"})
    started = time.monotonic()
    assert units.state("a10-2", "vllm-tp2") == "active"  # Type=simple: active as soon as it is forked
    seen_before: list[int | None] = []
    while time.monotonic() - started < 30:
        code = health("127.0.0.12", 8000)
        if code == 200:
            break
        seen_before.append(code)
        time.sleep(0.1)
    healthy_after = time.monotonic() - started
    assert code == 200, f"/health never turned 200 (saw {seen_before[-3:]})"
    assert healthy_after >= 2.0, f"/health was 200 after {healthy_after:.1f} s, before the 3 s load time"
    assert seen_before and all(c != 200 for c in seen_before)
    journal = units.journal("a10-2", "vllm-tp2")
    engine = [line for line in journal.splitlines() if "Initializing a V1 LLM engine" in line]
    assert engine and "tensor_parallel_size=2" in engine[0], journal[-2000:]


ERRORS = [
    pytest.param("a10-4", "--tensor-parallel-size 3",
                 "Total number of attention heads (16) must be divisible by tensor parallel size (3).",
                 id="tp3-heads"),
    pytest.param("a10-2", "--max-model-len 200000",
                 "User-specified max_model_len (200000) is greater than the derived max_model_len "
                 "(max_position_embeddings=131072.0 or model_max_length=None in model's config.json).",
                 id="max-model-len-too-long"),
    pytest.param("a10-2", "--tensor-parallel-size 4",
                 "World size (4) is larger than the number of available GPUs (2)", id="tp4-on-2-gpus"),
    # 10 % of an A10 leaves far less than the 2.25 GiB of KV cache one 131072-token request needs.
    pytest.param("a10-1", "--gpu-memory-utilization 0.1",
                 "To serve at least one request with the model's max seq len (131072)", id="kv-cache-too-small"),
]


@pytest.mark.parametrize(("host", "flags", "text"), ERRORS)
def test_startup_errors_reach_the_journal_verbatim(lab: Lab, units: Units, host: str, flags: str,
                                                   text: str) -> None:
    address = lab.require_state().host(host).address
    units.start(host, "vllm-bad", f"{VLLM} {flags} --port 8100 --host {address}",
                env={"VLLM_SIM_LOAD_SECONDS": "1"})
    assert units.wait_state(host, "vllm-bad", "failed") == "failed"
    journal = units.journal(host, "vllm-bad")
    assert text in journal, journal[-3000:]


def test_unsupported_architecture_is_rejected(lab: Lab, units: Units) -> None:
    config = json.loads(lab.ssh("a10-1", "cat /models/ERNIE-4.5-0.3B-PT/config.json").stdout)
    config["architectures"] = ["BogusForCausalLM"]
    made = lab.ssh("a10-1", "mkdir -p /models/Bogus && cat > /models/Bogus/config.json", input=json.dumps(config))
    assert made.returncode == 0, made.stderr
    try:
        units.start("a10-1", "vllm-arch", "/opt/vllm/0.34.0/bin/vllm serve /models/Bogus --port 8101 --host 127.0.0.11")
        assert units.wait_state("a10-1", "vllm-arch", "failed") == "failed"
        journal = units.journal("a10-1", "vllm-arch")
        assert "Model architectures ['BogusForCausalLM'] are not supported for now." in journal, journal[-3000:]
    finally:
        lab.ssh("a10-1", "rm -rf /models/Bogus")


def _stream(address: str, port: int, max_tokens: int, chunks: list[dict[str, object]],
            first: threading.Event) -> None:
    body = json.dumps({"model": "/models/ERNIE-4.5-0.3B-PT", "prompt": "rehearse a drain", "stream": True,
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://{address}:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                first.set()
            elif line == "data: [DONE]":
                chunks.append({"done": True})


def test_sigterm_drains_an_in_flight_stream(lab: Lab, units: Units) -> None:
    # Since vLLM 0.18 --shutdown-timeout defaults to 0 (in-flight requests are aborted); deployments set
    # it from vllm_drain_timeout, as here.
    units.start("a100-2", "vllm-drain",
                f"{VLLM} --max-model-len 4096 --port 8000 --host 127.0.0.14 --shutdown-timeout 30",
                env={"VLLM_SIM_LOAD_SECONDS": "1"})
    assert wait_for(lambda: health("127.0.0.14", 8000) == 200, 30)
    chunks: list[dict[str, object]] = []
    first = threading.Event()
    reader = threading.Thread(target=_stream, args=("127.0.0.14", 8000, 400, chunks, first), daemon=True)
    reader.start()
    assert first.wait(20), "the stream never started"
    stop = lab.ssh("a100-2", "systemctl stop vllm-drain.service; systemctl is-active vllm-drain.service")
    reader.join(60)
    assert not reader.is_alive()
    journal = units.journal("a100-2", "vllm-drain")
    assert chunks and chunks[-1] == {"done": True}, f"stream cut off after {len(chunks)} chunks:\n{journal[-1500:]}"
    tokens = [c for c in chunks if "choices" in c]
    assert len(tokens) >= 400 - 1  # every generated token arrived (the last chunk may carry only the reason)
    assert stop.stdout.strip() in ("inactive", "failed")
    assert "Waiting for connections to close." in journal, journal[-2000:]
    assert health("127.0.0.14", 8000) is None


def _finish_reasons(chunks: list[dict[str, object]]) -> list[object]:
    reasons: list[object] = []
    for chunk in chunks:
        choices = chunk.get("choices")
        if isinstance(choices, list):
            reasons += [c["finish_reason"] for c in choices if isinstance(c, dict) and c.get("finish_reason")]
    return reasons


@pytest.mark.parametrize("kill_mode", ["control-group", "mixed"])
def test_kill_mode_decides_whether_a_tp2_stream_survives_a_stop(lab: Lab, units: Units, kill_mode: str) -> None:
    """`systemctl stop` of a TP-2 instance with --shutdown-timeout 10 during a ~3 s stream.

    vLLM's GPU workers exit on SIGTERM; its EngineCore (>= 0.18) and API server drain. With systemd's default
    KillMode=control-group every process of the unit gets the SIGTERM at once: the workers exit, the engine
    dies with them, and the stream ends with the engine's error instead of its last tokens. With
    KillMode=mixed only the API server gets it, drains the stream, then ends its children itself.
    """
    address = lab.require_state().host("a10-2").address
    unit = f"vllm-{kill_mode}"  # journalctl -u shows every run of a unit name: one name per mode
    units.start("a10-2", unit,
                f"{VLLM} --tensor-parallel-size 2 --max-model-len 4096 --port 8002 --host {address} "
                "--shutdown-timeout 10",
                env={"VLLM_SIM_LOAD_SECONDS": "1"}, extra=f"KillMode={kill_mode}\nTimeoutStopSec=20\n")
    assert wait_for(lambda: health(address, 8002) == 200, 30)
    chunks: list[dict[str, object]] = []
    first = threading.Event()
    reader = threading.Thread(target=_stream, args=(address, 8002, 400, chunks, first), daemon=True)
    reader.start()
    assert first.wait(20), "the stream never started"
    stop = lab.ssh("a10-2", f"systemctl stop {unit}.service; systemctl is-active {unit}.service")
    reader.join(30)
    assert not reader.is_alive()
    journal = units.journal("a10-2", unit)
    finished = _finish_reasons(chunks)
    if kill_mode == "mixed":
        assert chunks[-1] == {"done": True} and len(finished) == 1, f"{len(chunks)} chunks:\n{journal[-1500:]}"
        assert "died unexpectedly" not in journal, journal[-2000:]
        assert stop.stdout.strip() == "inactive"  # exit 0
    else:
        assert not finished and any("error" in c for c in chunks), f"{chunks[-3:]}\n{journal[-1500:]}"
        assert len([c for c in chunks if "choices" in c]) < 400
        assert "] Worker proc VllmWorker-" in journal and "died unexpectedly (exit code: 0)" in journal, journal[-2000:]
        assert "EngineDeadError" in journal
        assert stop.stdout.strip() == "inactive"  # the API server exits 0 after the engine death, as real vLLM does


def test_second_instance_on_the_same_gpu_fails_on_free_memory(units: Units) -> None:
    units.start("a10-1", "vllm-first", f"{VLLM} --max-model-len 4096 --port 8000 --host 127.0.0.11",
                env={"VLLM_SIM_LOAD_SECONDS": "1"})
    assert wait_for(lambda: health("127.0.0.11", 8000) == 200, 30)
    units.start("a10-1", "vllm-second", f"{VLLM} --max-model-len 4096 --port 8001 --host 127.0.0.11",
                env={"VLLM_SIM_LOAD_SECONDS": "1"})
    assert units.wait_state("a10-1", "vllm-second", "failed") == "failed"
    journal = units.journal("a10-1", "vllm-second")
    assert "Free memory on device" in journal, journal[-3000:]
    assert units.state("a10-1", "vllm-first") == "active"
