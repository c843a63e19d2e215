"""Simulated `vllm` CLI for the rehearsal lab (`vllm --version`, `vllm serve MODEL [flags]`).

Faithful to docs/vllm-facts.md for what a deployment sees: the
flags per version, the start-up checks and their exact error texts, the log lines, the HTTP routes,
the process tree (APIServer → EngineCore → Worker_TPk) and GPU memory visible in `nvidia-smi`.
Nothing is computed on a GPU; see README.md for the knobs.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import signal
import socket
import sys
import threading
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import simstate
from .simstate import GpuProc, UsageEntry
from .vllm_args import parse_serve_args
from .vllm_http import ROUTES, ServerState, make_server
from .vllm_log import SITE, VllmLog, report_startup_error
from .vllm_model import (
    GIB,
    LENGTH_KEYS,
    LONG_LEN_WARNING,
    DerivedLen,
    EngineSettings,
    MemoryPlan,
    ModelInfo,
    StartupError,
    address_in_use_error,
    arch_error,
    cuda_oom_error,
    derive_max_len,
    dtype_bytes,
    expert_parallel_error,
    free_memory_error,
    generic_traceback_error,
    heads_error,
    kv_dtype_bytes,
    kv_too_small_error,
    load_model,
    load_oom_error,
    max_len_error,
    max_len_exceeded,
    moe_tp_error,
    nccl_error,
    no_kv_memory_error,
    plan_memory,
    ray_error,
    registry,
    torch_dtype_name,
    world_size_error,
)
from .vllm_versions import DEFAULT_VERSION, Profile, has_ernie, profile_for

DEFAULT_LOAD_SECONDS = 3.0
AUTO_FIT_SHORT_MAX_MODEL_LEN = 8192  # 0.34.0 vllm/v1/core/kv_cache_planning.py:61: shorter fits are a warning
CONTEXT_MIB = 500  # memory a process shows right after CUDA init, before weights
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
# The EngineCore's traceback when its executor failed: (0.11.0 line, 0.34.0 line, function, source line) in
# vllm/v1/engine/core.py of each wheel.
EXECUTOR_FAILED_FRAMES = (
    (701, 1743, "run_engine_core", "engine_core.run_busy_loop()"),
    (726, 1798, "run_busy_loop", "self._process_input_queue()"),
    (740, 1841, "_process_input_queue", "self._handle_client_request(*req)"),
    (786, 1985, "_handle_client_request", 'raise RuntimeError("Executor failed.")'),
)
FORCED_FAULTS = (
    "architecture", "max_model_len", "world_size", "attention_heads", "expert_parallel", "free_memory",
    "nccl", "moe_tp", "cuda_oom", "kv_cache", "address_in_use", "traceback",
)


def claimed_version() -> str:
    """The version of the `vllm` package this simulator is installed as (its real metadata, as on a lab
    host); run from a source tree (tests), `$ERNIE_LAB_ROOT/etc/ernie-lab/vllm_version`, else the default."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("vllm")
        if Path(str(dist.locate_file(__package__ or "-"))).resolve() == Path(__file__).resolve().parent:
            return dist.version
    try:
        text = simstate.version_path().read_text().strip()
    except FileNotFoundError:
        return DEFAULT_VERSION
    return text or DEFAULT_VERSION


def _prctl(option: int, arg: int | bytes) -> None:
    """Best-effort prctl(2): child processes die with the parent and carry vLLM's process names."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _exit_on_signal(signum: int, frame: Any) -> None:
    """WorkerProc.worker_main's handler: "Either SIGTERM or SIGINT will terminate the worker" by raising
    SystemExit (0.11.0 v1/executor/multiproc_executor.py:529-542, 0.34.0 :1003-1018); multiprocessing then
    reports exit code 0."""
    raise SystemExit


def _holder_main(name: str, parent: int, watch_key: str | None, exit_on_sigterm: bool = False) -> None:
    """Body of a forked EngineCore/Worker (or orphan): hold the GPU until the parent (or entry) goes.

    With `exit_on_sigterm` SIGTERM/SIGINT end it (status 0), as they end vLLM's GPU workers; otherwise they
    are ignored: the EngineCore of vLLM >= 0.18 takes SIGTERM as a drain request and keeps running until
    its API server shuts it down (0.34.0 v1/engine/core.py:1695-1716), and the orphan is a wedged process.
    """
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        handler = _exit_on_signal if exit_on_sigterm else signal.SIG_IGN
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        _prctl(PR_SET_NAME, f"VLLM::{name}".encode()[:15])
        if watch_key is None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        deadline = time.monotonic() + 7 * 24 * 3600  # a week: "forever" for a lab, yet bounded
        while time.monotonic() < deadline:
            if watch_key is None and os.getppid() != parent:
                break
            if watch_key is not None and not simstate.entry_exists(watch_key):
                break
            time.sleep(0.2)
    finally:
        os._exit(0)


def spawn_holder(name: str, exit_on_sigterm: bool) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _holder_main(name, parent, None, exit_on_sigterm)
    return pid


def spawn_orphan(procs: list[GpuProc]) -> None:
    """Double-fork a detached process that keeps holding this group's GPU memory (fault knob).

    It lives until its registry file is deleted (or a week passes), like a leaked EngineCore that only
    `kill PID` removes.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            key = f"orphan-{os.getpid()}"
            held = [GpuProc(os.getpid(), p.gpu_uuid, p.used_mib, 0, "VLLM::EngineCore") for p in procs]
            simstate.write_entry(UsageEntry(key, 0, held))
            os.write(write_fd, b"x")
            os.close(write_fd)
            _holder_main("EngineCore", 0, key)
        os._exit(0)
    os.close(write_fd)
    os.waitpid(middle, 0)
    with contextlib.suppress(OSError):
        os.read(read_fd, 1)  # wait until the orphan has registered, so nvidia-smi sees it at once
    os.close(read_fd)


@dataclass(frozen=True)
class Layout:
    """Process names and the GPU (index into the visible list) each GPU-holding process uses."""

    engine: str
    holders: tuple[tuple[str, int], ...]  # (process name, visible GPU position)

    @property
    def workers(self) -> list[str]:
        return [name for name, _ in self.holders if name.startswith("Worker")]


def make_layout(profile: Profile, tp: int, pp: int, dp: int) -> Layout:
    """vLLM names workers "Worker" + _DP/_PP/_TP suffixes for the dimensions larger than one."""
    engine = profile.engine_proc if dp == 1 else "EngineCore_DP0"
    world = tp * pp
    if world == 1 and dp == 1:
        return Layout(engine, ((engine, 0),))
    holders: list[tuple[str, int]] = []
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                name = "Worker" + (f"_DP{d}" if dp > 1 else "") + (f"_PP{p}" if pp > 1 else "")
                name += f"_TP{t}" if tp > 1 else ""
                holders.append((name, d * world + p * tp + t))
    return Layout(engine, tuple(holders))


def visible_gpus(host: simstate.HostGpus | None) -> list[simstate.Gpu]:
    """GPUs selected (and ordered) by CUDA_VISIBLE_DEVICES: indices or UUIDs into gpus.json."""
    if host is None:
        return []
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(host.gpus)
    chosen: list[simstate.Gpu] = []
    for item in (s.strip() for s in spec.split(",")):
        match = [g for g in host.gpus if str(g.index) == item or g.uuid == item]
        if not match:
            break  # CUDA stops at the first invalid entry
        chosen.append(match[0])
    return chosen


def load_seconds(faults: dict[str, Any]) -> float:
    """faults.json (per-port over top-level) > $VLLM_SIM_LOAD_SECONDS > 3 s."""
    if "load_seconds" in faults:
        return float(faults["load_seconds"])
    return float(os.environ.get("VLLM_SIM_LOAD_SECONDS", DEFAULT_LOAD_SECONDS))


def _fmt_gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def format_gib(value: float) -> str:
    """vLLM 0.34's vllm/utils/mem_utils.py format_gib: `f"{round(b / GiB_bytes, 2)}"` (19.2, not 19.20)."""
    return f"{round(value / GIB, 2)}"


class Serve:
    """One `vllm serve` run: start-up checks and log, then the HTTP server, then shutdown."""

    def __init__(self, args: Namespace, non_default: dict[str, Any], profile: Profile) -> None:
        self.args = args
        self.non_default = non_default
        self.profile = profile
        self.pids: dict[str, int] = {"APIServer": os.getpid()}
        self.log = VllmLog(profile, self.pids)
        self.children: list[int] = []
        self.entry_key = f"vllm-{os.getpid()}"
        self.procs: list[GpuProc] = []
        self.sock: socket.socket | None = None
        self.faults = self._faults()
        self.forced = str(self.faults.get("fail_startup", "")) or None
        self.stop = threading.Event()
        self.exit_code = 0
        self.registry_lock = threading.Lock()
        self.state: ServerState | None = None
        self.model_path = str(args.model or "Qwen/Qwen3-0.6B")
        self.served_name = (args.served_model_name or [self.model_path])[0]
        self.layout = make_layout(profile, args.tensor_parallel_size, args.pipeline_parallel_size,
                                  args.data_parallel_size)
        self.t0 = time.monotonic()
        self.budget = load_seconds(self.faults)
        # Child-death watch (serving and draining): `children_lock` guards `children` and `watching`; the
        # server clears `watching` before it kills its own children, so only deaths it did not cause count.
        self.children_lock = threading.Lock()
        self.watching = False
        self.watcher: threading.Thread | None = None
        self.death_lock = threading.Lock()
        self.died = False

    # -- lifecycle -------------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm_loading)
        try:
            try:
                self._startup()
            except StartupError as err:
                first_worker = self.layout.workers[0] if self.layout.workers else None
                report_startup_error(self.log, err, self.model_path, self.layout.engine, first_worker)
                return 1
            return self._serve()
        finally:
            self._cleanup()

    def _faults(self) -> dict[str, Any]:
        """faults.json for this instance; entries with a "when" count only if this run's arguments match."""
        return simstate.load_faults(self.args.port, self.args)

    def _forced(self, name: str) -> bool:
        return self.forced == name

    def _pause(self, fraction: float) -> None:
        time.sleep(max(0.0, self.budget * fraction))

    def _on_sigterm_loading(self, signum: int, frame: Any) -> None:
        # vLLM installs this during initialisation (0.11 setup_server; 0.34 _interrupt_init).
        if self._faults().get("ignore_sigterm"):
            return
        raise KeyboardInterrupt("terminated")

    def _on_sigterm_serving(self, signum: int, frame: Any) -> None:
        if self._faults().get("ignore_sigterm"):
            return
        self.stop.set()

    def _kill_children(self) -> None:
        """The server ends its own children (shutdown, or after an engine death): not a death to report."""
        with self.children_lock:
            self.watching = False
            children, self.children = list(self.children), []
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def _cleanup(self) -> None:
        self._kill_children()
        simstate.remove_entry(self.entry_key)
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- start-up --------------------------------------------------------------------------------
    def _startup(self) -> None:
        p, a, log = self.profile, self.args, self.log
        if p.new_banner:
            # Printed plainly, as with VLLM_DISABLE_LOG_LOGO=1 (the default ASCII logo is not modelled).
            log.info("APIServer", "startup.py:18", f"vLLM server version {p.version}, serving model {self.model_path}")
            log.info("APIServer", "startup.py:96", f"non-default args: {self.non_default!r}")
        else:
            log.info("APIServer", "api_server.py:1839", f"vLLM API server version {p.version}")
            log.info("APIServer", "utils.py:233", f"non-default args: {self.non_default!r}")
        self._bind()
        model = self._model_config()
        max_len = self._max_model_len(model)
        self._parallel_config()
        self._vllm_config(model)
        self._pause(0.05)
        self._spawn_engine(model, max_len)
        self._init_workers(model)
        self._model_init(model)
        plan = self._load_and_profile(model, max_len)
        self._go_live(model, max_len if a.max_model_len != -1 else self.auto_len, plan)

    def _bind(self) -> None:
        """vLLM binds the port before building the engine but listens only once it is up."""
        host = self.args.host or ""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.args.port))
        except OSError as err:
            sock.close()
            raise address_in_use_error() from err
        self.sock = sock
        if self._forced("address_in_use"):
            raise address_in_use_error()

    def _model_config(self) -> ModelInfo:
        try:
            model = load_model(self.model_path)
        except (OSError, ValueError) as err:
            raise StartupError(
                "api",
                "pydantic:ModelConfig",
                f"Invalid repository ID or local directory specified: '{self.model_path}'.\nPlease verify "
                "the following requirements:\n1. Provide a valid Hugging Face repository ID.\n2. Specify a "
                "local directory that contains a recognized configuration file.\n   - For Hugging Face "
                "models: ensure the presence of a 'config.json'.\n   - For Mistral models: ensure the "
                "presence of a 'params.json'.",
            ) from err
        supported = registry(self.profile, has_ernie(self.profile.version))
        arch = next((x for x in model.architectures if x in supported), None)
        if arch is None or self._forced("architecture"):
            raise arch_error(model, supported)
        self.log.info("APIServer", "model.py:547", f"Resolved architecture: {arch}")
        return model

    def _max_model_len(self, model: ModelInfo) -> int:
        p = self.profile
        derived: DerivedLen = derive_max_len(model, p)
        requested = self.args.max_model_len
        if derived.key is None and requested in (None, -1):  # a given length is used as is, silently
            keys = f" following keys to determine the original maximum length of the model: {list(LENGTH_KEYS)!r}."
            self.log.warning(
                "APIServer", "model.py:1832" if p.len_keys_listed else "model.py:2634",
                "The model's config.json does not contain any of the"
                + (keys if p.len_keys_listed else " keys to determine the original maximum length of the model.")
                + " Assuming the model's maximum length is 2048.",
            )
        if self._forced("max_model_len") and requested in (None, -1):
            requested = 2 * int(derived.value)  # the knob fails even without --max-model-len
        if requested is None or requested == -1:
            value = int(derived.value)
        elif requested > derived.value or self._forced("max_model_len"):
            if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1" and not self._forced("max_model_len"):
                # logger.warning_once("%s %s", msg, warning) (0.11.0 config/model.py:1907, 0.34.0 :2722)
                self.log.warning("APIServer", "model.py:1907" if p.len_keys_listed else "model.py:2722",
                                 f"{max_len_exceeded(requested, derived)} {LONG_LEN_WARNING}")
                value = requested
            else:
                raise max_len_error(requested, derived, self.profile)
        else:
            value = requested
        self.derived_len = int(derived.value)
        self.auto_len = value
        self.log.info("APIServer", "model.py:1510", f"Using max model len {value}")
        return value

    def _parallel_config(self) -> None:
        a = self.args
        world = a.tensor_parallel_size * a.pipeline_parallel_size
        self.gpus = visible_gpus(simstate.load_host_gpus())
        if a.distributed_executor_backend == "ray":
            raise StartupError("api", "pydantic:ParallelConfig", ray_error())
        needed = world * a.data_parallel_size
        if needed > len(self.gpus) or self._forced("world_size"):
            raise world_size_error(needed, len(self.gpus), self.profile)

    def _vllm_config(self, model: ModelInfo) -> None:
        tp = self.args.tensor_parallel_size
        if model.heads % tp != 0 or self._forced("attention_heads"):
            raise heads_error(model, tp)
        if (self.args.enable_expert_parallel and not model.num_experts) or self._forced("expert_parallel"):
            raise expert_parallel_error()

    def _engine_settings(self, max_len: int, model: ModelInfo) -> EngineSettings:
        a = self.args
        dbytes = dtype_bytes(a.dtype, model)
        return EngineSettings(
            tp=a.tensor_parallel_size,
            gpu_util=self.gpu_util,
            max_model_len=max_len,
            max_num_batched_tokens=a.max_num_batched_tokens or 2048,
            max_num_seqs=a.max_num_seqs or 256,
            dtype_bytes=dbytes,
            kv_dtype_bytes=kv_dtype_bytes(a.kv_cache_dtype, dbytes),
            enforce_eager=bool(a.enforce_eager),
        )

    @property
    def gpu_util(self) -> float:
        return float(self.args.gpu_memory_utilization or self.profile.gpu_util_default)

    def _engine_config_line(self, model: ModelInfo, max_len: int) -> str:
        a, p = self.args, self.profile
        fields = [
            f"model={self.model_path!r}", "speculative_config=None", f"tokenizer={self.model_path!r}",
            "skip_tokenizer_init=False", "tokenizer_mode=auto", "revision=None", "override_neuron_config={}",
            "tokenizer_revision=None", f"trust_remote_code={bool(a.trust_remote_code)}",
            f"dtype=torch.{torch_dtype_name(a.dtype, model)}", f"max_seq_len={max_len}", "download_dir=None",
            "load_format=auto", f"tensor_parallel_size={a.tensor_parallel_size}",
            f"pipeline_parallel_size={a.pipeline_parallel_size}", f"data_parallel_size={a.data_parallel_size}",
        ]
        if p.newer_engine_fields:
            fields += ["decode_context_parallel_size=1", "dcp_comm_backend=ag_rs"]
        fields += [f"disable_custom_all_reduce={bool(a.disable_custom_all_reduce)}", "quantization=None"]
        if p.newer_engine_fields:
            fields.append("quantization_config=None")
        prefix_caching = True if a.enable_prefix_caching is None else a.enable_prefix_caching
        fields += [
            f"enforce_eager={bool(a.enforce_eager)}", f"kv_cache_dtype={a.kv_cache_dtype}", "device_config=cuda",
            f"seed={a.seed if a.seed is not None else 0}", f"served_model_name={self.served_name}",
            f"enable_prefix_caching={prefix_caching}",
            ("enable_chunked_prefill=True" if p.newer_engine_fields else "chunked_prefill_enabled=True"),
            "pooler_config=None",
        ]
        if p.newer_engine_fields:
            fields.append("aux_output_config=None")
        return ", ".join(fields)

    def _spawn_engine(self, model: ModelInfo, max_len: int) -> None:
        engine = self.layout.engine
        # Before 0.18 the EngineCore's SIGTERM handler raises SystemExit (0.11.0 v1/engine/core.py:675-682);
        # from 0.18 it requests a drain and the engine runs on (rolling.md 4.2, 4.5).
        self.pids[engine] = spawn_holder(engine, exit_on_sigterm=not self.profile.has_shutdown_timeout)
        self.children.append(self.pids[engine])
        where = "core.py:154" if self.profile.newer_engine_fields else "core.py:77"
        self.log.info(engine, where, f"Initializing a V1 LLM engine (v{self.profile.version}) with config: "
                      + self._engine_config_line(model, max_len))
        for name in self.layout.workers:
            self.pids[name] = spawn_holder(name, exit_on_sigterm=True)
            self.children.append(self.pids[name])

    def _rank_line(self, rank: int, world: int, moe: bool) -> str:
        """vLLM's initialize_model_parallel line (0.11.0 distributed/parallel_state.py:1208, 0.34.0 :2394)."""
        tp = self.args.tensor_parallel_size
        pp_rank, tp_rank = rank // tp, rank % tp
        if not self.profile.rank_line_pcp:
            return (f"rank {rank} in world size {world} is assigned as DP rank 0, PP rank {pp_rank}, TP rank "
                    f"{tp_rank}, EP rank {tp_rank}")
        # 0.34 builds no EP group for dense models ("N/A"), no EPLB group without --enable-eplb, and the
        # Engram TP group is the TP group unless an Engram config says otherwise.
        ep = str(tp_rank) if moe else "N/A"
        return (f"rank {rank} in world size {world} is assigned as DP rank 0, PP rank {pp_rank}, PCP rank 0, "
                f"TP rank {tp_rank}, ETP rank {tp_rank}, EP rank {ep}, EPLB rank N/A")

    def _init_workers(self, model: ModelInfo) -> None:
        """Device init per rank: NCCL, custom all-reduce checks, and the free-memory check (locked)."""
        a, log = self.args, self.log
        world = a.tensor_parallel_size * a.pipeline_parallel_size
        host = simstate.load_host_gpus()
        where = "parallel_state.py:2394" if self.profile.rank_line_pcp else "parallel_state.py:1208"
        # Every GPU process logs its rank, the EngineCore too when it holds the only GPU (TP=PP=DP=1).
        for rank, (name, _) in enumerate(self.layout.holders):
            log.info(name, where, self._rank_line(rank, world, bool(model.num_experts)))
        if self._forced("nccl"):
            raise nccl_error()
        if a.tensor_parallel_size > 1 and not a.disable_custom_all_reduce:
            self._custom_all_reduce_warning(host)
        self._pause(0.10)
        self._claim_gpu_memory()

    def _custom_all_reduce_warning(self, host: simstate.HostGpus | None) -> None:
        tp = self.args.tensor_parallel_size
        for name in self.layout.workers:
            if tp not in (2, 4, 6, 8):
                self.log.warning(name, "custom_all_reduce.py:134",
                                 f"Custom allreduce is disabled due to an unsupported world size: {tp}. Supported "
                                 "world sizes: [2, 4, 6, 8]. To silence this warning, specify "
                                 "disable_custom_all_reduce=True explicitly.")
            elif tp > 2 and not (host and host.nvlink):
                self.log.warning(name, "custom_all_reduce.py:144",
                                 "Custom allreduce is disabled because it's not supported on more than two "
                                 "PCIe-only GPUs. To silence this warning, specify disable_custom_all_reduce=True "
                                 "explicitly.")

    def _claim_gpu_memory(self) -> None:
        """Reserve util × total on every GPU of the group, atomically across instances on the host."""
        util = self.gpu_util
        with simstate.usage_lock():
            simstate.cleanup_stale_entries()
            held = simstate.held_mib_by_gpu(exclude_key=self.entry_key)
            procs: list[GpuProc] = []
            for name, position in self.layout.holders:
                gpu = self.gpus[position]
                total = gpu.memory_total_mib * simstate.MIB
                free = total - held.get(gpu.uuid, 0) * simstate.MIB
                if free < total * util or self._forced("free_memory"):
                    raise free_memory_error(free, total, util, position, self.profile)
                reserved = round(gpu.memory_total_mib * util)
                procs.append(GpuProc(self.pids[name], gpu.uuid, CONTEXT_MIB, reserved, f"VLLM::{name}"))
            self.procs = procs
            self._publish(0)

    def _publish(self, utilization: int) -> None:
        with self.registry_lock:
            simstate.write_entry(UsageEntry(self.entry_key, utilization, self.procs))

    def _model_init(self, model: ModelInfo) -> None:
        tp = self.args.tensor_parallel_size
        if (model.num_experts and tp > model.num_experts) or self._forced("moe_tp"):
            raise moe_tp_error(tp, model.num_experts)

    def _load_and_profile(self, model: ModelInfo, max_len: int) -> MemoryPlan:
        log, v2 = self.log, self.profile.gpu_model_runner_v2
        holders = [name for name, _ in self.layout.holders]
        for name in holders:
            if v2:  # 0.34.0 vllm/v1/worker/gpu/model_runner.py:412 (info_once)
                log.info(name, "model_runner.py:412", "Loading model from scratch...")
            else:
                log.info(name, "gpu_model_runner.py:2602", f"Starting to load model {self.model_path}...")
        started = time.monotonic()
        self._pause(0.45)
        while self.faults.get("hang_loading"):
            time.sleep(0.5)  # never finishes; SIGTERM (KeyboardInterrupt) or SIGKILL ends it
        settings = self._engine_settings(max_len, model)
        gpu = self.gpus[0]
        plan = plan_memory(model, gpu.memory_total_mib * simstate.MIB, settings, self.profile)
        if plan.weights + CONTEXT_MIB * simstate.MIB > plan.total:
            raise load_oom_error(plan.total, plan.weights)
        took = time.monotonic() - started
        for name in holders:
            log.info(name, "default_loader.py:543" if v2 else "default_loader.py:268",
                     f"Loading weights took {took * 0.8:.2f} seconds")
            if v2:
                log.info(name, "model_runner.py:441",
                         f"Model loading took {format_gib(plan.weights)} GiB memory and {took:.6f} seconds")
            else:
                log.info(name, "gpu_model_runner.py:2653",
                         f"Model loading took {plan.weights / GIB:.4f} GiB and {took:.6f} seconds")
        weights_mib = plan.weights // simstate.MIB
        self.procs = [GpuProc(p.pid, p.gpu_uuid, CONTEXT_MIB + weights_mib, p.reserved_mib, p.process_name)
                      for p in self.procs]
        self._publish(0)
        self._pause(0.15)
        if self._forced("cuda_oom"):
            raise cuda_oom_error(plan.total, self.gpu_util)
        if self._forced("traceback"):
            raise generic_traceback_error()
        kv_where = "gpu_worker.py:796" if self.profile.newer_engine_fields else "gpu_worker.py:298"
        kv_gib = format_gib(plan.available_kv) if v2 else _fmt_gib(plan.available_kv)
        for name in holders:
            log.info(name, kv_where, f"Available KV cache memory: {kv_gib} GiB")
        self._check_kv(plan, max_len)
        return plan

    def _check_kv(self, plan: MemoryPlan, max_len: int) -> None:
        if plan.available_kv <= 0:
            raise no_kv_memory_error()
        if a_auto := (self.args.max_model_len == -1):
            self._auto_fit(plan)
        fits = plan.needed_for_max_len <= plan.available_kv
        if (not fits and not a_auto) or self._forced("kv_cache"):
            raise kv_too_small_error(plan, max_len, self.gpu_util, self.profile)

    def _auto_fit(self, plan: MemoryPlan) -> None:
        """0.34 `--max-model-len auto`: shrink to what the KV cache holds.

        Log texts per docs/vllm-facts.md#max-model-length.
        """
        fit = min(self.derived_len, plan.estimated_max_len())
        engine, derived = self.layout.engine, self.derived_len
        # vllm/v1/core/kv_cache_planning.py (0.34.0), the path without the extensible KV cache.
        memory = f"{format_gib(plan.available_kv)} GiB GPU"
        if fit >= derived:
            self.log.info(engine, "kv_cache_planning.py:1466", f"Auto-fit max_model_len: full model context length "
                          f"{derived} fits in available KV cache memory ({memory})")
        elif fit >= AUTO_FIT_SHORT_MAX_MODEL_LEN:
            self.log.info(engine, "kv_cache_planning.py:1494", f"--max-model-len auto reduced max_model_len from "
                          f"{derived} to {fit} ({memory} available for the KV cache).")
        else:
            hint = ("Increase `gpu_memory_utilization` or set --max-model-len explicitly." if self.gpu_util < 1.0
                    else "Use more GPUs or set --max-model-len explicitly.")
            self.log.warning(engine, "kv_cache_planning.py:1506", f"--max-model-len auto reduced max_model_len "
                             f"from {derived} to {fit} ({memory} available for the KV cache). Requests longer "
                             f"than {fit} tokens will be rejected. {hint}")
        self.auto_len = fit

    def _go_live(self, model: ModelInfo, max_len: int, plan: MemoryPlan) -> None:
        a, p, log = self.args, self.profile, self.log
        engine = self.layout.engine
        tokens, conc = f"{plan.kv_tokens:,}", plan.concurrency(max_len)
        if p.kv_one_line:
            log.info(engine, "kv_cache_utils.py:1169", f"GPU KV cache size: {tokens} tokens, Maximum concurrency "
                     f"for {max_len:,} tokens per request: {conc:.2f}x")
        else:
            log.info(engine, "kv_cache_utils.py:1087", f"GPU KV cache size: {tokens} tokens")
            log.info(engine, "kv_cache_utils.py:1091",
                     f"Maximum concurrency for {max_len:,} tokens per request: {conc:.2f}x")
        used = [round(g.memory_total_mib * self.gpu_util) for g in (self.gpus[pos] for _, pos in self.layout.holders)]
        self.procs = [GpuProc(pr.pid, pr.gpu_uuid, u, pr.reserved_mib, pr.process_name)
                      for pr, u in zip(self.procs, used, strict=True)]
        self._publish(0)
        if not a.enforce_eager:
            self._pause(0.20)
            where = "model_runner.py:1216" if p.gpu_model_runner_v2 else "gpu_model_runner.py:3480"
            for name, _ in self.layout.holders:
                log.info(name, where,
                         f"Graph capturing finished in {max(1, round(self.budget * 0.2))} secs, took "
                         f"{plan.cudagraph / GIB:.2f} GiB")
        elapsed = time.monotonic() - self.t0
        log.info(engine, "core.py:210", "init engine (profile, create kv cache, warmup model) took "
                 f"{elapsed:.2f} {p.init_took_unit}")
        self._pause(0.05)
        self.kv_tokens = plan.kv_tokens
        self.max_len = max_len
        self.max_num_seqs = a.max_num_seqs or 256

    # -- serving ---------------------------------------------------------------------------------
    def _api_keys(self) -> list[str] | None:
        keys = self.args.api_key
        if keys:
            return list(keys) if isinstance(keys, list) else [keys]
        env = os.environ.get("VLLM_API_KEY")
        return [env] if env else None

    def _on_load_change(self, running: int) -> None:
        # Equal across the TP group: one utilization per registry entry.
        self._publish(0 if running == 0 else min(99, 40 + 12 * running))

    def _serve(self) -> int:
        a, p, log = self.args, self.profile, self.log
        assert self.sock is not None
        shown_host = a.host or "0.0.0.0"
        url = f"http://{shown_host}:{a.port}"
        if p.new_server_start:
            log.info("APIServer", "entry.py:139" if p.launcher_entry else "api_server.py:139",
                     f"Starting vLLM server on {url}")
        else:
            log.info("APIServer", "api_server.py:1912", f"Starting vLLM API server 0 on {url}")
        log.info("APIServer", "launcher.py:34", "Available routes are:")
        for route, methods in ROUTES:
            log.info("APIServer", "launcher.py:42", f"Route: {route}, Methods: {methods}")
        self.state = ServerState(
            profile=p,
            served_name=self.served_name,
            model_root=self.model_path,
            max_model_len=self.max_len,
            kv_tokens=self.kv_tokens,
            max_num_seqs=self.max_num_seqs,
            api_keys=self._api_keys(),
            health_503=lambda: bool(self._faults().get("health_503")),
            on_load_change=self._on_load_change,
            access_log=None if a.disable_uvicorn_access_log else log.uvicorn,
            on_stream_error=self._log_stream_error,
        )
        server = make_server(self.sock, self.state)
        signal.signal(signal.SIGTERM, self._on_sigterm_serving)
        signal.signal(signal.SIGINT, self._on_sigterm_serving)
        log.uvicorn(f"Started server process [{os.getpid()}]")
        log.uvicorn("Waiting for application startup.")
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        thread.start()
        log.uvicorn("Application startup complete.")
        self._start_watching()
        crash_after = self.faults.get("crash_after_s")
        if crash_after is not None:
            threading.Timer(float(crash_after), self._crash).start()
        while not self.stop.wait(0.2):
            pass
        self._shutdown(server)
        return self.exit_code

    # -- engine death ----------------------------------------------------------------------------
    def _start_watching(self) -> None:
        with self.children_lock:
            self.watching = True
        self.watcher = threading.Thread(target=self._watch_children, name="MultiprocWorkerMonitor", daemon=True)
        self.watcher.start()

    def _stop_watching(self) -> None:
        """Stop the watch and let a death it has already seen finish its lines (before the server exits)."""
        with self.children_lock:
            self.watching = False
        if self.watcher is not None and self.watcher is not threading.current_thread():
            self.watcher.join(timeout=10)

    def _watch_children(self) -> None:
        """vLLM's liveness monitors: the executor's MultiprocWorkerMonitor waits on the workers' sentinels (0.11.0
        v1/executor/multiproc_executor.py:145-165, 0.34.0 :395-419), the client's monitor on the engine's
        (0.11.0 v1/engine/core_client.py:555-566, 0.34.0 :863-870). Here the API server polls its children."""
        while True:
            time.sleep(0.2)
            with self.children_lock:
                if not self.watching:
                    return
                exited = None
                for pid in self.children:
                    try:
                        got, status = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        got, status = pid, 0
                    if got:
                        exited = (pid, os.waitstatus_to_exitcode(status))
                        self.children.remove(pid)
                        break
            if exited is not None:
                self._child_died(*exited)
                return

    def _child_died(self, pid: int, exit_code: int) -> None:
        name = next((n for n, p in self.pids.items() if p == pid), "")
        if not name.startswith("Worker"):
            self._engine_dead()
            return
        engine = self.layout.engine
        rank = [n for n, _ in self.layout.holders].index(name)
        # The executor's monitor, in the EngineCore process; the process is named f"VllmWorker-{rank}"
        # (0.11.0 multiproc_executor.py:468, 0.34.0 :882).
        if self.profile.worker_death_exit_code:
            self.log.log(engine, "ERROR", "multiproc_executor.py:404",
                         f"Worker proc VllmWorker-{rank} died unexpectedly (exit code: {exit_code}), shutting down "
                         "executor.")
        else:
            self.log.log(engine, "ERROR", "multiproc_executor.py:154",
                         f"Worker proc VllmWorker-{rank} died unexpectedly, shutting down executor.")
        # The failure callback queues EXECUTOR_FAILED; the busy loop raises RuntimeError("Executor failed."),
        # run_engine_core logs it and sends ENGINE_CORE_DEAD to the client (0.11.0 v1/engine/core.py:471-472,
        # 706-711, 785-786; 0.34.0 :1353-1354, 1756-1760, 1984-1985).
        v034 = self.profile.newer_engine_fields  # core.py line numbers as elsewhere in this file
        frames = "".join(f'  File "{SITE}/v1/engine/core.py", line {line_034 if v034 else line_011}, in {func}\n'
                         f"    {code}\n" for line_011, line_034, func, code in EXECUTOR_FAILED_FRAMES)
        where = "core.py:1759" if v034 else "core.py:710"
        self.log.log(engine, "ERROR", where, "EngineCore encountered a fatal error.")
        self.log.log(engine, "ERROR", where,
                     f"Traceback (most recent call last):\n{frames}RuntimeError: Executor failed.")
        self._engine_dead(client_saw_exit=False)

    def _crash(self) -> None:
        """The crash_after_s knob: the engine processes vanish while serving."""
        if self.stop.is_set():
            return
        self._engine_dead(crash_knob=True)

    def _engine_dead(self, client_saw_exit: bool = True, crash_knob: bool = False) -> None:
        """Engine death seen by the API server: children gone, /health 503, every request in flight ended with
        EngineDeadError, then the server exits non-zero.

        `client_saw_exit`: the client's own monitor saw the engine exit (after a dead worker the engine's
        ENGINE_CORE_DEAD message comes first and that monitor stays quiet). The server stops once the
        launcher's watchdog sees the errored engine (terminate_if_errored every VLLM_WATCHDOG_TIME_S = 5 s,
        0.11.0 entrypoints/launcher.py:105-127, 0.34.0 entrypoints/launchers/launcher.py:315-322): here 1 s,
        during which /health answers 503. The crash_after_s knob keeps its older order (503 first, then the
        EngineDeadError line)."""
        with self.death_lock:
            if self.died or self.state is None:
                return
            self.died = True
        state = self.state
        self.exit_code = 1
        self._kill_children()
        new = self.profile.engine_exit_warning
        if client_saw_exit:
            if new:  # 0.34.0 v1/engine/core_client.py:869 (warning_once)
                self.log.warning("APIServer", "core_client.py:869",
                                 "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
            else:
                self.log.log("APIServer", "ERROR", "core_client.py:564",
                             f"Engine core proc {self.layout.engine} died unexpectedly, shutting down client.")
        if crash_knob:
            state.engine_dead = True  # /health answers 503 from now on
            time.sleep(1.0)
        self.log.log("APIServer", "ERROR", "async_llm.py:957" if new else "async_llm.py:480",
                     "AsyncLLM output_handler failed.\n"
                     "Traceback (most recent call last):\n"
                     "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                     "(above) for the root cause.")
        state.mark_dead()  # output_processor.propagate_error: every request in flight gets EngineDeadError
        if not crash_knob:
            time.sleep(1.0)
        self.stop.set()

    def _log_stream_error(self, chat: bool) -> None:
        """The stream generator's logger.exception for EngineDeadError (see vllm_http._stream_engine_dead)."""
        new = self.profile.engine_dead_client_message
        if chat:
            where, what = ("serving.py:963" if new else "serving_chat.py:1145"), "chat completion"
        elif new:
            where, what = "serving.py:623", "completion"
        else:
            return  # 0.11's completion stream generator sends the error without logging it
        self.log.log("APIServer", "ERROR", where,
                     f"Error in {what} stream generator.\nTraceback (most recent call last):\n"
                     "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                     "(above) for the root cause.")

    def _shutdown(self, server: Any) -> None:
        """uvicorn's graceful shutdown: stop accepting, drain in-flight requests, then tear down."""
        assert self.state is not None
        state = self.state
        self.log.uvicorn("Shutting down")
        server.shutdown()
        server.socket.close()
        self.sock = None
        # Before 0.18 uvicorn waits for open connections without a limit. From 0.18 --shutdown-timeout
        # exists and defaults to 0: in-flight requests are aborted (vLLM docs PR #43208).
        timeout = getattr(self.args, "shutdown_timeout", None)
        if timeout is None and self.profile.has_shutdown_timeout:
            timeout = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.died:  # requests the dead engine ended are sending their error at once; let them finish
            deadline = time.monotonic() + 2.0
        with state.lock:
            if state.inflight:
                self.log.uvicorn("Waiting for connections to close. (CTRL+C to force quit)")
            while state.inflight:
                remaining = 1.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    break
                state.idle.wait(min(remaining, 1.0))
        # Workers that died while we drained (KillMode=control-group signals them too) were reported above;
        # from here on the server ends its children itself.
        self._stop_watching()
        self.log.uvicorn("Waiting for application shutdown.")
        self.log.uvicorn("Application shutdown complete.")
        if self._faults().get("orphan_gpu_memory") and self.procs:
            spawn_orphan(self.procs)
        self.log.uvicorn(f"Finished server process [{os.getpid()}]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    version = claimed_version()
    profile = profile_for(version)
    if argv[:1] in (["--version"], ["-v"]):
        # Real vLLM imports torch and its platform stack before it prints its version: 14-24 s for 0.33.0 on
        # a 2-core machine. `version_seconds` rehearses that (tools must read the package metadata instead).
        time.sleep(float(simstate.load_faults(None).get("version_seconds", 0)))
        print(version)
        return 0
    if argv[:1] != ["serve"]:
        sys.stderr.write("usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...\n"
                         "vllm: error: only `vllm serve` and `vllm --version` are simulated\n")
        return 2
    args, non_default = parse_serve_args(argv[1:], profile)
    return Serve(args, non_default, profile).run()


if __name__ == "__main__":
    sys.exit(main())
