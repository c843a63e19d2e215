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
from .vllm_versions import Profile

SITE = "/opt/vllm/lib/python3.12/site-packages/vllm"


class VllmLog:
    """Writes lines as `(Proc pid=N) LEVEL MM-DD HH:MM:SS [file.py:LINE] message`."""

    def __init__(self, profile: Profile, pids: dict[str, int]) -> None:
        self.profile = profile
        self.pids = pids  # process name -> pid, filled in as processes are spawned
        self._lock = threading.Lock()

    def prefix(self, proc: str) -> str:
        pid = self.pids.get(proc, 0)
        if self.profile.decorated_logs:
            return f"({proc} pid={pid}) "
        if proc.startswith("Worker"):
            rank = int(proc.rsplit("TP", 1)[-1]) if "TP" in proc else 0
            return f"(VllmWorker rank={rank} pid={pid}) "
        return ""

    def _write(self, stream: TextIO, text: str) -> None:
        with self._lock:
            stream.write(text)
            stream.flush()

    def log(self, proc: str, level: str, where: str, message: str) -> None:
        """One log record; vLLM's formatter repeats the header on every line of a multi-line message."""
        stamp = time.strftime("%m-%d %H:%M:%S")
        head = f"{self.prefix(proc)}{level} {stamp} [{where}] "
        self._write(sys.stdout, "".join(f"{head}{line}\n" for line in message.split("\n")))

    def info(self, proc: str, where: str, message: str) -> None:
        self.log(proc, "INFO", where, message)

    def warning(self, proc: str, where: str, message: str) -> None:
        self.log(proc, "WARNING", where, message)

    def raw(self, proc: str, text: str, stream: TextIO | None = None) -> None:
        """Lines printed outside the logger (uvicorn, tracebacks): decorate_logs still prefixes them."""
        prefix = self.prefix(proc) if self.profile.decorated_logs else ""
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


def exception_lines(err: StartupError, model_path: str) -> str:
    """The final line(s) naming the exception, pydantic-wrapped where vLLM's config is a pydantic dataclass."""
    if err.exc.startswith("pydantic:"):
        cls = err.exc.split(":", 1)[1]
        return (
            f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {cls}\n"
            f"  Value error, {err.message} [type=value_error, input_value=ArgsKwargs((), {{'model': "
            f"'{model_path}', ...}}), input_type=ArgsKwargs]\n"
            "    For further information visit https://errors.pydantic.dev/2.11/v/value_error"
        )
    return f"{err.exc}: {err.message}"


def report_startup_error(
    log: VllmLog, err: StartupError, model_path: str, engine: str, first_worker: str | None
) -> None:
    """Print the failure the way it reaches the journal: root cause first, then the API server's error."""
    exc = exception_lines(err, model_path)
    stage = err.stage if (err.stage != "worker" or first_worker) else "engine"
    if stage == "api":
        frames = _API_FRAMES + (_CONFIG_FRAMES + "    ...\n" if err.exc.startswith(("pydantic", "Value")) else "")
        log.raw("APIServer", f"Traceback (most recent call last):\n{frames}{exc}", sys.stderr)
        return
    if stage == "worker" and first_worker:
        where = "multiproc_executor.py:597"
        log.log(first_worker, "ERROR", where, "WorkerProc failed to start.")
        log.log(first_worker, "ERROR", where, f"Traceback (most recent call last):\n{_WORKER_FRAMES}{exc}")
        exc = (
            "Exception: WorkerProc initialization failed due to an exception in a background process. "
            "See stack trace for root cause."
        )
    log.log(engine, "ERROR", "core.py:708", "EngineCore failed to start.")
    log.log(engine, "ERROR", "core.py:708", f"Traceback (most recent call last):\n{_ENGINE_FRAMES}{exc}")
    log.raw(engine, f"Process {engine}:\nTraceback (most recent call last):\n{_ENGINE_FRAMES}{exc}", sys.stderr)
    api_tail = (
        f'  File "{SITE}/v1/engine/core_client.py", line 932, in _wait_for_engine_startup\n'
        '    raise RuntimeError("Engine core initialization failed. "\n'
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    )
    log.raw("APIServer", f"Traceback (most recent call last):\n{_API_FRAMES}{api_tail}", sys.stderr)
