"""The faults.json knob `stall`: an engine that stops making progress while its server still looks healthy.

Real vLLM can hang this way: the API server keeps answering `/health` (and `/version`, `/v1/models`) with 200 and
accepts requests (`POST /v1/chat/completions` 200, then nothing), while the engine produces no token
(vllm-project/vllm#39863, 0.19.0: "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 3 reqs,
GPU KV cache usage: 0.0%", no error logged; a 0.26.1rc1 engine deadlock reported in azrtydxb/Fastllm-proxy#19 stayed
at "Running: 2 reqs, 0.0 tokens/s" for over an hour). The two forms are the knob's two values:

* ``true`` (or ``"running"``): the engine's step hangs (a wedged forward pass or collective). Requests it runs get
  no further token (streams send nothing more, no error), new ones are accepted and never scheduled, and
  /metrics keeps the scheduler gauges the engine last reported (``num_requests_running`` > 0 when it hung with
  work) while ``vllm:generation_tokens_total`` stops: vLLM sets those gauges from the stats each engine step sends
  back, and a hung step sends none.
* ``"waiting"``: the scheduler admits nothing (#39863's form). Running requests finish, new ones queue:
  ``num_requests_waiting`` grows while nothing runs.

When it takes effect: the knob is read live (every POLL_S) and hits a process that is serving when it is set;
clearing it (absent, ``false`` or ``null``) lets that process resume. A process that starts while the knob is
already set serves normally until the knob is cleared and set again: a hang belongs to the process it happened in,
so a restart cures it, as it does for the real thing.

Shutdown of a stalled engine is vLLM's shutdown with an engine that never finishes a request (vllm_shutdown.py):
0.32 drains it for `--shutdown-timeout` seconds, then force-kills the EngineCore and the requests end with
EngineDeadError; the uvicorn-first profiles abort them at once from 0.18 (`--shutdown-timeout` 0), and before
0.18 uvicorn waits for them without a limit, so only systemd's SIGKILL after `TimeoutStopSec` ends such a unit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from .vllm_http import ServerState

POLL_S = 0.2  # how often a serving process re-reads the knob


def stall_mode(value: Any) -> str | None:
    """The knob's value as a stall mode ("running" or "waiting"), None for no stall; ValueError for anything else."""
    if value is None or value is False:
        return None
    if value is True or value == "running":
        return "running"
    if value == "waiting":
        return "waiting"
    raise ValueError(f'stall must be true, "running", "waiting", false or null, got {value!r}')


class StallWatch:
    """Polls the knob for one serving process and applies its changes to the server's state (see module doc)."""

    def __init__(self, faults: Callable[[], dict[str, Any]], state: ServerState, stop: threading.Event,
                 where: str) -> None:
        self.faults = faults
        self.state = state
        self.stop = stop
        self.where = where  # faults.json's path, for the message about a bad value
        self.armed = self._read() is None  # a knob set before this process served does not hit it
        self.reported: set[str] = set()

    def _read(self) -> str | None:
        value = self.faults().get("stall")
        try:
            return stall_mode(value)
        except ValueError as err:
            # Checked at start (vllm_sim.py); a bad value written later cannot stop a serving process, so it is
            # named once on stderr (the journal) and leaves the engine as it was.
            text = repr(value)
            if text not in self.reported:
                self.reported.add(text)
                sys.stderr.write(f"{self.where}: {err}\n")
            return self.state.stall_mode

    def poll(self) -> None:
        """One look at the knob."""
        mode = self._read()
        if mode is None:
            self.armed = True
        if self.armed and mode != self.state.stall_mode:
            self.state.set_stall(mode)

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.poll()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="StallWatch", daemon=True)
        thread.start()
        return thread
