"""`vllm bench serve` against one instance, run on its host: the intent, its command and the parse of what the
host printed. The program (programs/bench_run.py, the host's python3) probes /health first, reads vLLM's counters
before and after, bounds the bench in time and prints the saved result back; the spec, argv and the reading of
the result are pure (planning/bench.py)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import ClassVar

from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.programs import program
from ernie_deploy.remote.protocol import marker, records

TAG = "bench"
MARK = marker(TAG)
PROGRAM = program("bench_run")
# Seconds between the SIGINT at the time bound and the SIGKILL: vllm bench cancels its requests and exits in
# well under a second; a stuck one must not hold the host's turn.
GRACE = 15.0
# Seconds the command may take beyond the bench's bound: /health, /metrics twice, the SIGINT grace.
MARGIN = GRACE + 60.0
RESULT_NAME = "result.json"


@dataclass(frozen=True)
class Bench(Intent):
    """One bench of `unit` (its instance at `base_url`, served as `served`): `argv` as `user`, stopped after
    `timeout` seconds, its result saved in `result_dir` (made and removed by the run)."""

    op: ClassVar[Op] = Op.BENCH
    unit: str
    base_url: str
    served: str
    argv: tuple[str, ...]
    result_dir: str
    user: str
    timeout: float

    def render(self) -> str:
        return (f"if command -v python3 >/dev/null; then python3 -c {shlex.quote(PROGRAM)}; "
                f"else printf '{MARK}%s\\n' '{{\"event\": \"error\", \"error\": \"python3 not found on the host\"}}'; "
                "fi\n")

    @property
    def label(self) -> str:
        return f"{self.op.value} {self.unit}"


def bench_command(intent: Bench, api_key: str | None) -> Command:
    """The command: its spec, API key included, on stdin."""
    spec = {"base": intent.base_url, "served": intent.served, "argv": list(intent.argv), "dir": intent.result_dir,
            "name": RESULT_NAME, "user": intent.user, "timeout": intent.timeout, "grace": GRACE,
            "api_key": api_key, "mark": MARK}
    return Command(intent, stdin=json.dumps(spec).encode(), timeout=intent.timeout + MARGIN, check=False)


@dataclass
class BenchRun:
    """What the host reported of one bench run."""

    health: int | None = None  # /health's status (None: no answer, `health_error` says why)
    health_error: str | None = None
    before: str = ""  # vLLM's counter lines of /metrics before the bench
    after: str = ""
    exit_code: int | None = None  # None: the bench did not run
    timed_out: bool = False
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)  # the last lines the bench printed
    result: str | None = None  # the saved result file's text
    error: str | None = None  # what stopped the host program

    @property
    def reached(self) -> bool:
        """The program ran and probed the instance."""
        return self.health is not None or self.health_error is not None


def parse(text: str) -> BenchRun:
    """The events the host program printed; lines that are not its records (or not JSON) are skipped."""
    run = BenchRun()
    for record in records(text, TAG):
        try:
            event = json.loads(record)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        kind = event.get("event")
        if kind == "health":
            run.health, run.health_error = event.get("status"), event.get("error")
        elif kind == "metrics":
            if event.get("when") == "before":
                run.before = str(event.get("text") or "")
            else:
                run.after = str(event.get("text") or "")
        elif kind == "exit":
            run.exit_code, run.timed_out = event.get("code"), bool(event.get("timed_out"))
            run.seconds = float(event.get("seconds") or 0.0)
            run.tail = [str(line) for line in event.get("tail") or []]
        elif kind == "result":
            run.result = str(event.get("text") or "")
        elif kind == "error":
            run.error = str(event.get("error") or "unknown error")
    return run
