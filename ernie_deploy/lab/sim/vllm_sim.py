"""Simulated `vllm` CLI for the rehearsal lab (`vllm --version`, `vllm serve MODEL [flags]`, `vllm bench serve`).

Faithful to docs/vllm-facts.md for what a deployment sees: the
flags per version, the start-up checks and their exact error texts, the log lines, the HTTP routes,
the process tree (APIServer → EngineCore → Worker_TPk) and GPU memory visible in `nvidia-smi`.
Nothing is computed on a GPU; see README.md for the knobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import signal
import socket
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from . import simstate, vllm_bench
from .simstate import GpuProc, UsageEntry
from .vllm_args import parse_serve_args
from .vllm_hang import StallWatch, stall_mode
from .vllm_http import ROUTES, ServerState, make_server
from .vllm_latency import LatencyModel
from .vllm_log import VllmLog, report_startup_error
from .vllm_metrics import cache_info
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
    format_gib,
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
from .vllm_procs import make_layout, spawn_holder
from .vllm_shutdown import DEATH_LINES_WAIT_S, ShutdownMixin
from .vllm_sites import (
    CUSTOM_FUSIONS,
    ENFORCE_EAGER_WARNING,
    INDUCTOR_OFF_WARNING,
    IR_OP_PRIORITY,
    LOGO,
    ROUTES_032,
    SCALE_OUT_OFF,
    SITES_032,
    engine_config_tail_032,
)
from .vllm_versions import DEFAULT_VERSION, Profile, has_ernie, profile_for

DEFAULT_LOAD_SECONDS = 3.0
AUTO_FIT_SHORT_MAX_MODEL_LEN = 8192  # 0.34.0 vllm/v1/core/kv_cache_planning.py:61: shorter fits are a warning
CONTEXT_MIB = 500  # memory a process shows right after CUDA init, before weights
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


class Serve(ShutdownMixin):
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
        self.latency = self._latency_model()  # checked before anything starts
        self._check_stall_knob()
        self.stop = threading.Event()
        self.signalled = False  # SIGTERM/SIGINT set `stop` (else the dead engine's watchdog did)
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
        self.death_logged = threading.Event()  # the engine death's lines are out and its requests ended
        self.client_closed = False  # the engine client (MPClient) was shut down (0.32's `[shutdown]` lines)

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

    def site(self, key: str, default: str) -> str:
        """`file.py:LINE` of a log call: the version's own (vllm_sites.py) where the profile has a table."""
        return SITES_032[key] if self.profile.forms_032 else default

    def _once(self, names: list[str]) -> list[str]:
        """The processes that log an `*_once` line: from 0.32 only the first local rank (vllm/logger.py)."""
        return names[:1] if self.profile.once_rank0 else names

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
        self.signalled = True
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
        if p.logo_banner:
            # api_utils.py log_version_and_model: the logo unless VLLM_DISABLE_LOG_LOGO is a non-zero integer.
            plain = os.environ.get("VLLM_DISABLE_LOG_LOGO", "0").strip() not in ("", "0")
            banner = (f"vLLM server version {p.version}, serving model {self.model_path}" if plain
                      else LOGO.format(version=p.version, model=self.model_path))
            log.info("APIServer", SITES_032["banner"], banner)
            log.info("APIServer", SITES_032["non_default_args"], f"non-default args: {self.non_default!r}")
        elif p.new_banner:
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
        self._config_lines("APIServer")
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
        self.log.info("APIServer", self.site("resolved_arch", "model.py:547"), f"Resolved architecture: {arch}")
        return model

    def _max_model_len(self, model: ModelInfo) -> int:
        p = self.profile
        derived: DerivedLen = derive_max_len(model, p)
        requested = self.args.max_model_len
        if derived.key is None and requested in (None, -1):  # a given length is used as is, silently
            keys = f" following keys to determine the original maximum length of the model: {list(LENGTH_KEYS)!r}."
            self.log.warning(
                "APIServer", self.site("len_fallback", "model.py:1832" if p.len_keys_listed else "model.py:2634"),
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
                where = self.site("long_len_allowed", "model.py:1907" if p.len_keys_listed else "model.py:2722")
                self.log.warning("APIServer", where,
                                 f"{max_len_exceeded(requested, derived)} {LONG_LEN_WARNING}")
                value = requested
            else:
                raise max_len_error(requested, derived, self.profile)
        else:
            value = requested
        self.derived_len = int(derived.value)
        self.auto_len = value
        self.log.info("APIServer", self.site("max_model_len", "model.py:1510"), f"Using max model len {value}")
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
            raise heads_error(model, tp, self.profile)
        if (self.args.enable_expert_parallel and not model.num_experts) or self._forced("expert_parallel"):
            raise expert_parallel_error(self.profile)

    def _config_lines(self, proc: str) -> None:
        """What 0.32 logs each time a process finishes its VllmConfig: in the API server before the engine starts and
        in the EngineCore once it is up (captured; config/vllm.py, kernel.py, compilation.py)."""
        if not self.profile.forms_032:
            return
        if self.args.enforce_eager:
            self.log.warning(proc, SITES_032["enforce_eager"], ENFORCE_EAGER_WARNING)
            self.log.warning(proc, SITES_032["inductor_off"], INDUCTOR_OFF_WARNING)
        self.log.info(proc, SITES_032["ir_op_priority"], IR_OP_PRIORITY)
        self.log.info(proc, SITES_032["custom_fusions"], CUSTOM_FUSIONS)

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
        prefix_caching = True if a.enable_prefix_caching is None else a.enable_prefix_caching
        if p.forms_032:  # the captured field list (core.py:133)
            return ", ".join([
                f"model={self.model_path!r}", "speculative_config=None", f"tokenizer={self.model_path!r}",
                "skip_tokenizer_init=False", "tokenizer_mode=auto", "revision=None", "tokenizer_revision=None",
                f"trust_remote_code={bool(a.trust_remote_code)}", f"dtype=torch.{torch_dtype_name(a.dtype, model)}",
                f"max_seq_len={max_len}", "download_dir=None", f"load_format={a.load_format}",
                f"tensor_parallel_size={a.tensor_parallel_size}", f"pipeline_parallel_size={a.pipeline_parallel_size}",
                f"data_parallel_size={a.data_parallel_size}", "decode_context_parallel_size=1",
                "dcp_comm_backend=ag_rs",
                f"disable_custom_all_reduce={bool(a.disable_custom_all_reduce)}", "quantization=None",
                "quantization_config=None", f"enforce_eager={bool(a.enforce_eager)}",
                *engine_config_tail_032(bool(a.enforce_eager), a.kv_cache_dtype, a.seed, self.served_name,
                                        prefix_caching),
            ])
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
        where = self.site("engine_config", "core.py:154" if self.profile.newer_engine_fields else "core.py:77")
        self.log.info(engine, where, f"Initializing a V1 LLM engine (v{self.profile.version}) with config: "
                      + self._engine_config_line(model, max_len))
        for name in self.layout.workers:
            self.pids[name] = spawn_holder(name, exit_on_sigterm=True)
            self.children.append(self.pids[name])
        if self.layout.workers and self.profile.forms_032:
            # MultiprocExecutor (TP > 1 on CUDA; TP 1 runs in the EngineCore): multiproc_executor.py:153.
            world = len(self.layout.workers)
            self.log.info(engine, SITES_032["dp_group_leader"], "DP group leader: node_rank=0, node_rank_within_dp=0, "
                          f"master_addr=127.0.0.1, mq_connect_ip=127.0.0.1 (local), world_size={world}, "
                          f"local_world_size={world}")

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
        where = self.site("rank_line", "parallel_state.py:2394" if self.profile.rank_line_pcp else
                          "parallel_state.py:1208")
        names = [name for name, _ in self.layout.holders]
        if self.profile.forms_032:
            # init_distributed_environment, every rank, before its parallel groups name it (parallel_state.py:1906).
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
            for rank, name in enumerate(names):
                log.log(name, "INFO", SITES_032["world_init"], f"world_size={world} rank={rank} local_rank={rank} "
                        f"distributed_init_method={method} backend=nccl", shown=self._early_name(name))
        # Every GPU process logs its rank (0.32: the first only), the EngineCore too when it holds the only GPU.
        for rank, name in enumerate(self._once(names)):
            log.log(name, "INFO", where, self._rank_line(rank, world, bool(model.num_experts)),
                    shown=self._early_name(name))
        if self._forced("nccl"):
            raise nccl_error()
        if a.tensor_parallel_size > 1 and not a.disable_custom_all_reduce:
            self._custom_all_reduce_warning(host)
        if self.profile.forms_032 and self.profile.gpu_model_runner_v2:
            log.log(names[0], "INFO", SITES_032["v2_runner"], "Using V2 Model Runner", shown=self._early_name(names[0]))
        self._pause(0.10)
        self._claim_gpu_memory()

    def _early_name(self, name: str) -> str | None:
        """0.32's workers log as `Worker` until init_device has built their parallel groups."""
        return "Worker" if self.profile.forms_032 and name.startswith("Worker") else None

    def _custom_all_reduce_warning(self, host: simstate.HostGpus | None) -> None:
        tp = self.args.tensor_parallel_size
        if tp not in (2, 4, 6, 8):  # warning_once (0.32: the first rank only)
            for name in self._once(self.layout.workers):
                self.log.log(name, "WARNING", self.site("allreduce_world_size", "custom_all_reduce.py:134"),
                             f"Custom allreduce is disabled due to an unsupported world size: {tp}. Supported world "
                             "sizes: [2, 4, 6, 8]. To silence this warning, specify disable_custom_all_reduce=True "
                             "explicitly.", shown=self._early_name(name))
        elif tp > 2 and not (host and host.nvlink):
            for name in self.layout.workers:
                self.log.log(name, "WARNING", self.site("allreduce_pcie", "custom_all_reduce.py:144"),
                             "Custom allreduce is disabled because it's not supported on more than two PCIe-only "
                             "GPUs. To silence this warning, specify disable_custom_all_reduce=True explicitly.",
                             shown=self._early_name(name))

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
        first = self._once(holders)
        for name in holders:
            if v2:  # 0.34.0 vllm/v1/worker/gpu/model_runner.py:412 (info_once: 0.32 logs it on the first rank)
                if name in first:
                    log.info(name, self.site("loading_from_scratch", "model_runner.py:412"),
                             "Loading model from scratch...")
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
            if self.profile.forms_032 and name in first:  # base_loader.py:82 (info_once)
                log.info(name, SITES_032["init_model_took"], f"Initializing model took {took * 0.2:.6f} seconds")
            # DefaultModelLoader's line; `--load-format dummy` (DummyModelLoader) loads no weights to time.
            if self.args.load_format != "dummy" and name in (first if self.profile.once_rank0 else holders):
                log.info(name, self.site("loading_weights", "default_loader.py:543" if v2 else "default_loader.py:268"),
                         f"Loading weights took {took * 0.8:.2f} seconds")
            if v2:
                log.info(name, self.site("model_loading_took", "model_runner.py:441"),
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
        kv_where = self.site("available_kv", "gpu_worker.py:796" if self.profile.newer_engine_fields else
                             "gpu_worker.py:298")
        kv_gib = format_gib(plan.available_kv) if v2 else _fmt_gib(plan.available_kv)
        for name in first:
            log.info(name, kv_where, f"Available KV cache memory: {kv_gib} GiB")
        self._check_kv(plan, max_len)
        return plan

    def _check_kv(self, plan: MemoryPlan, max_len: int) -> None:
        if plan.available_kv <= 0:
            raise no_kv_memory_error(self.profile)
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
        memory = f"{format_gib(plan.available_kv)} GiB GPU"
        if self.profile.auto_fit_kv_utils:  # 0.32.0 v1/core/kv_cache_utils.py:2453-2483 (info_once)
            if fit >= derived:
                self.log.info(engine, SITES_032["auto_fit_full"], f"Auto-fit max_model_len: full model context length "
                              f"{derived} fits in available KV cache memory ({memory})")
            else:
                self.log.info(engine, SITES_032["auto_fit_reduced"], f"Auto-fit max_model_len: reduced from {derived} "
                              f"to {fit} to fit in available KV cache memory ({memory})")
            self.auto_len = fit
            return
        # vllm/v1/core/kv_cache_planning.py (0.34.0), the path without the extensible KV cache.
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
            log.info(engine, self.site("kv_cache_size", "kv_cache_utils.py:1169"), f"GPU KV cache size: {tokens} "
                     "tokens, Maximum concurrency "
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
            where = self.site("graph_capturing", "model_runner.py:1216" if p.gpu_model_runner_v2 else
                              "gpu_model_runner.py:3480")
            for name, _ in self.layout.holders:
                log.info(name, where,
                         f"Graph capturing finished in {max(1, round(self.budget * 0.2))} secs, took "
                         f"{plan.cudagraph / GIB:.2f} GiB")
        elapsed = time.monotonic() - self.t0
        log.info(engine, self.site("init_engine_took", "core.py:210"), "init engine (profile, create kv cache, warmup "
                 f"model) took {elapsed:.2f} {p.init_took_unit}")
        self._config_lines(engine)
        self._pause(0.05)
        self.kv_tokens = plan.kv_tokens
        self.kv_bytes = plan.available_kv
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

    def _latency_model(self) -> LatencyModel:
        """The instance's latency model: its TP, and the faults.json knobs `latency_scale` (every time multiplied)
        and `token_seconds` (an exact time per output token), both read at start."""
        scale, pinned = self.faults.get("latency_scale", 1.0), self.faults.get("token_seconds")
        try:
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                raise ValueError(f"latency_scale must be a number > 0, got {scale!r}")
            if pinned is not None and (isinstance(pinned, bool) or not isinstance(pinned, int | float)):
                raise ValueError(f"token_seconds must be a number >= 0, got {pinned!r}")
            return LatencyModel(tp=self.args.tensor_parallel_size, scale=float(scale),
                                token_seconds=None if pinned is None else float(pinned))
        except ValueError as err:
            # The lab writes faults.json; a bad knob is the rehearsal's mistake, named with its file.
            raise SystemExit(f"{simstate.faults_path()}: {err}") from err

    def _check_stall_knob(self) -> None:
        """faults.json `stall` (vllm_hang.py) is read live, but a bad value present at start stops `vllm serve`
        with exit 1 naming the file, as a bad `latency_scale` does."""
        try:
            stall_mode(self.faults.get("stall"))
        except ValueError as err:
            raise SystemExit(f"{simstate.faults_path()}: {err}") from err

    def _serve(self) -> int:
        a, p, log = self.args, self.profile, self.log
        assert self.sock is not None
        shown_host = a.host or "0.0.0.0"
        url = f"http://{shown_host}:{a.port}"
        if p.forms_032:  # captured; the chat-template lines depend on the tokenizer, absent here
            log.info("APIServer", SITES_032["supported_tasks"], "Supported tasks: ['generate']")
            log.info("APIServer", SITES_032["scale_out_off"], SCALE_OUT_OFF)
        if p.new_server_start:
            where = self.site("server_start", "entry.py:139" if p.launcher_entry else "api_server.py:139")
            log.info("APIServer", where, f"Starting vLLM server on {url}")
        else:
            log.info("APIServer", "api_server.py:1912", f"Starting vLLM API server 0 on {url}")
        log.info("APIServer", self.site("routes_header", "launcher.py:34"), "Available routes are:")
        for route, methods in ROUTES_032 if p.forms_032 else ROUTES:
            log.info("APIServer", self.site("route", "launcher.py:42"), f"Route: {route}, Methods: {methods}")
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
            on_drain_reject=self._log_drain_reject,
            on_dead_reply=self._terminate_if_errored,
            latency=self.latency,
            log_stats=not a.disable_log_stats,
        )
        if p.forms_032:
            digest = hashlib.sha256(f"{self.model_path}|{self.served_name}|{self.max_len}".encode()).hexdigest()
            self.state.fingerprint = f"vllm-{p.version}-{digest[:8]}"
            prefix_caching = True if a.enable_prefix_caching is None else bool(a.enable_prefix_caching)
            self.state.cache_info = cache_info(self.kv_tokens, self.kv_tokens / self.max_len, self.gpu_util,
                                               self.kv_bytes, prefix_caching, a.kv_cache_dtype)
        server = make_server(self.sock, self.state)
        signal.signal(signal.SIGTERM, self._on_sigterm_serving)
        signal.signal(signal.SIGINT, self._on_sigterm_serving)
        log.uvicorn(f"Started server process [{os.getpid()}]")
        log.uvicorn("Waiting for application startup.")
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        thread.start()
        log.uvicorn("Application startup complete.")
        self._start_watching()
        StallWatch(self._faults, self.state, self.stop, str(simstate.faults_path())).start()
        crash_after = self.faults.get("crash_after_s")
        if crash_after is not None:
            threading.Timer(float(crash_after), self._crash).start()
        while not self.stop.wait(0.2):
            pass
        if self.died:  # the death's lines come first, however the stop came
            self.death_logged.wait(DEATH_LINES_WAIT_S)
        # A signal runs 0.32's own shutdown, a dead engine's watchdog (or its 500) uvicorn's `should_exit` one;
        # either way the process exits 0.
        if p.engine_first_shutdown and self.signalled:
            self._shutdown_engine_first(server)
        else:
            self._shutdown(server)
        return 0


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
    if argv[:2] == ["bench", "serve"]:
        return vllm_bench.main(argv[2:])
    if argv[:1] != ["serve"]:
        sys.stderr.write("usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...\n"
                         "vllm: error: only `vllm serve`, `vllm bench serve` and `vllm --version` are simulated\n")
        return 2
    args, non_default = parse_serve_args(argv[1:], profile)
    return Serve(args, non_default, profile).run()


if __name__ == "__main__":
    sys.exit(main())
