"""vLLM-style log output for the simulator: per-process prefixes, INFO/WARNING lines and tracebacks.

Log lines go to stdout (vLLM's VLLM_LOGGING_STREAM default) and tracebacks to stderr, both flushed per
line because under systemd they stream into journald.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from .vllm_model import StartupError
from .vllm_sites import (
    CONFIG_FRAMES_032,
    PYDANTIC_DOCS_032,
    PYDANTIC_FRAME,
    PYDANTIC_INPUT_032,
    SITES_032,
    api_frames_032,
)
from .vllm_versions import Profile

PACKAGES = "/opt/vllm/lib/python3.12/site-packages"
SITE = f"{PACKAGES}/vllm"


class VllmLog:
    """Writes lines as `(Proc pid=N) LEVEL MM-DD HH:MM:SS [file.py:LINE] message`."""

    def __init__(self, profile: Profile, pids: dict[str, int]) -> None:
        self.profile = profile
        self.pids = pids  # process name -> pid, filled in as processes are spawned
        self._lock = threading.Lock()

    def prefix(self, proc: str, shown: str | None = None) -> str:
        """`shown`: the name the process logs under when it differs from its final one (0.32's workers log as
        `Worker` until their parallel groups exist: v1/executor/multiproc_executor.py
        setup_proc_title_and_log_prefix)."""
        pid = self.pids.get(proc, 0)
        if self.profile.decorated_logs:
            return f"({shown or proc} pid={pid}) "
        if proc.startswith("Worker"):
            rank = int(proc.rsplit("TP", 1)[-1]) if "TP" in proc else 0
            return f"(VllmWorker rank={rank} pid={pid}) "
        return ""

    def _write(self, stream: TextIO, text: str) -> None:
        with self._lock:
            stream.write(text)
            stream.flush()

    def log(self, proc: str, level: str, where: str, message: str, shown: str | None = None) -> None:
        """One log record; vLLM's formatter repeats the header on every line of a multi-line message."""
        stamp = time.strftime("%m-%d %H:%M:%S")
        head = f"{self.prefix(proc, shown)}{level} {stamp} [{where}] "
        self._write(sys.stdout, "".join(f"{head}{line}\n" for line in message.split("\n")))

    def info(self, proc: str, where: str, message: str) -> None:
        self.log(proc, "INFO", where, message)

    def warning(self, proc: str, where: str, message: str) -> None:
        self.log(proc, "WARNING", where, message)

    def raw(self, proc: str, text: str, stream: TextIO | None = None) -> None:
        """Lines printed outside the logger (uvicorn, tracebacks): decorate_logs still prefixes them, except where
        the prefix is part of the logger's format (0.32)."""
        prefix = self.prefix(proc) if self.profile.decorated_logs and not self.profile.bare_raw_lines else ""
        self._write(stream or sys.stdout, "".join(f"{prefix}{line}\n" for line in text.split("\n")))

    def uvicorn(self, text: str) -> None:
        self.raw("APIServer", f"INFO:     {text}")


# ---------------------------------------------------------------------------------------------------
# Tracebacks. Frames are abbreviated but shaped like the real ones so log scanners see the same
# anchors: "Traceback (most recent call last):", the exception line, and the final RuntimeError.

_API_FRAMES = (
    '  File "/opt/vllm/bin/vllm", line 10, in <module>\n    sys.exit(main())\n'
    f'  File "{SITE}/entrypoints/cli/main.py", line 54, in main\n    args.dispatch_function(args)\n'
    f'  File "{SITE}/entrypoints/cli/serve.py", line 57, in cmd\n    uvloop.run(run_server(args))\n'
    f'  File "{SITE}/entrypoints/openai/api_server.py", line 1884, in run_server\n'
    "    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)\n"
)
_CONFIG_FRAMES = (
    f'  File "{SITE}/entrypoints/openai/api_server.py", line 186, in build_async_engine_client_from_engine_args\n'
    "    vllm_config = engine_args.create_engine_config(usage_context=usage_context)\n"
    f'  File "{SITE}/engine/arg_utils.py", line 1142, in create_engine_config\n'
)
_ENGINE_FRAMES = (
    f'  File "{SITE}/v1/engine/core.py", line 699, in run_engine_core\n'
    "    engine_core = EngineCoreProc(*args, **kwargs)\n"
    f'  File "{SITE}/v1/engine/core.py", line 498, in __init__\n'
    "    super().__init__(vllm_config, executor_class, log_stats,\n"
    f'  File "{SITE}/v1/engine/core.py", line 92, in __init__\n'
    "    self._initialize_kv_caches(vllm_config)\n"
)
_WORKER_FRAMES = (
    f'  File "{SITE}/v1/executor/multiproc_executor.py", line 571, in worker_main\n'
    "    worker = WorkerProc(*args, **kwargs)\n"
    f'  File "{SITE}/v1/worker/gpu_worker.py", line 187, in init_device\n'
)


def exception_lines(err: StartupError, model_path: str, profile: Profile) -> str:
    """The final line(s) naming the exception, pydantic-wrapped where vLLM's config is a pydantic dataclass."""
    if err.exc.startswith("pydantic:"):
        cls = err.exc.split(":", 1)[1]
        args = f"ArgsKwargs((), {{'model': '{model_path}', ...}})"
        docs = "https://errors.pydantic.dev/2.11/v/value_error"
        if profile.forms_032:  # captured; ParallelConfig's cut repr is our guess [UNVERIFIED]
            args = PYDANTIC_INPUT_032.get(cls, "ArgsKwargs((), {'pipeline_... 'distributed_timeout_seconds': None})")
            docs = PYDANTIC_DOCS_032
        return (
            f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {cls}\n"
            f"  Value error, {err.message} [type=value_error, input_value={args}, input_type=ArgsKwargs]\n"
            f"    For further information visit {docs}"
        )
    return f"{err.exc}: {err.message}"


def _api_frames(err: StartupError, profile: Profile) -> str:
    """The API server's uncaught traceback down to the config that refused the arguments."""
    if not profile.forms_032:
        return _API_FRAMES + (_CONFIG_FRAMES + "    ...\n" if err.exc.startswith(("pydantic", "Value")) else "")
    if not err.exc.startswith(("pydantic", "Value")):
        return api_frames_032(SITE, "")
    cls = err.exc.split(":", 1)[1] if err.exc.startswith("pydantic:") else "VllmConfig"
    config = CONFIG_FRAMES_032.get(cls, CONFIG_FRAMES_032["VllmConfig"]).format(site=SITE)
    return api_frames_032(SITE, config + PYDANTIC_FRAME.format(packages=PACKAGES))


def report_startup_error(
    log: VllmLog, err: StartupError, model_path: str, engine: str, first_worker: str | None
) -> None:
    """Print the failure the way it reaches the journal: root cause first, then the API server's error."""
    profile = log.profile
    exc = exception_lines(err, model_path, profile)
    stage = err.stage if (err.stage != "worker" or first_worker) else "engine"
    if stage == "api":
        log.raw("APIServer", f"Traceback (most recent call last):\n{_api_frames(err, profile)}{exc}", sys.stderr)
        return
    if stage == "worker" and first_worker:
        where = "multiproc_executor.py:597"
        log.log(first_worker, "ERROR", where, "WorkerProc failed to start.")
        log.log(first_worker, "ERROR", where, f"Traceback (most recent call last):\n{_WORKER_FRAMES}{exc}")
        exc = (
            "Exception: WorkerProc initialization failed due to an exception in a background process. "
            "See stack trace for root cause."
        )
    failed_at = SITES_032["engine_failed"] if profile.forms_032 else "core.py:708"
    log.log(engine, "ERROR", failed_at, "EngineCore failed to start.")
    log.log(engine, "ERROR", failed_at, f"Traceback (most recent call last):\n{_ENGINE_FRAMES}{exc}")
    log.raw(engine, f"Process {engine}:\nTraceback (most recent call last):\n{_ENGINE_FRAMES}{exc}", sys.stderr)
    if profile.forms_032:  # the engine manager's shutdown as the client gives up (captured start-kv-too-small.log)
        log.info("APIServer", SITES_032["pm_sigterm"], "[shutdown] Process manager: send sigterm to process EngineCore")
    api_tail = (
        f'  File "{SITE}/v1/engine/core_client.py", line 932, in _wait_for_engine_startup\n'
        '    raise RuntimeError("Engine core initialization failed. "\n'
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    )
    log.raw("APIServer", f"Traceback (most recent call last):\n{_API_FRAMES}{api_tail}", sys.stderr)
