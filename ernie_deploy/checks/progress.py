"""Forward progress of a running instance, judged from two /metrics readings a few seconds apart.

vLLM's `/health` answers 200 while its engine is hung (vllm issue #39863): requests sit in the running batch and
no token comes out. Only the engine's own counters show it, so this judges two readings of
`vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges) and `vllm:generation_tokens_total` (the
counter `vllm:generation_tokens`; prometheus_client appends `_total` to a counter's samples), all labelled by
engine and model_name (vllm 0.11.0 to 0.34.0 `vllm/v1/metrics/loggers.py`; a real 0.32.0 page is
tests/fixtures/real-vllm/0.32.0/http/metrics.txt). `vllm:kv_cache_usage_perc` (a gauge, 1 = full) is read as
context for the evidence. docs/progress.md says what each state means and what to do.

Pure: orchestration/progress.py reads the pages on the host (remote/programs/progress_read.py) and passes
the text in. An instance with nothing running or waiting in its first reading needs no second one
(`needs_second_reading`), so an idle fleet costs no wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ernie_deploy.checks.metrics import parse_sample
from ernie_deploy.checks.result import CheckResult
from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.coerce import coerce

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
NEEDED = (RUNNING, WAITING, GENERATED)

STATES = ("ok", "idle", "stalled", "stuck", "not-generating", "unreadable")
# The states a restart of the instance clears: its engine is hung or its scheduler wedged.
HUNG = ("stalled", "stuck", "not-generating")
HEALTHY = ("ok", "idle")
# What each unhealthy state says about the engine: verify's check names it as the cause.
CAUSES = {
    "stalled": "the engine is hung: requests sit in the running batch and no token comes out, while /health may "
               "still answer 200 (vllm issue #39863)",
    "stuck": "the scheduler admits no request: the queue grows while nothing runs",
    "not-generating": "the engine is hung: its gauges read idle (they froze when it hung) and /health answers 200, "
                      "but a request gets no token",
    "unreadable": "without vLLM's /metrics nothing shows whether the engine makes progress",
}

# The inventory variables of the thresholds (docs/variables.md), each with the range it may take and the fix
# for a value outside it. The window bounds the remote program's sleep; an hour is far past any useful window.
MAX_WINDOW_S = 3600.0
VARIABLES: dict[str, tuple[str, float, float, str]] = {
    # variable: (Thresholds field, exclusive low, inclusive high, fix)
    "vllm_progress_window": ("window_s", 0.0, MAX_WINDOW_S,
                             "to the seconds between the two /metrics readings, e.g. 5"),
    "vllm_progress_min_tokens": ("min_tokens", 0.0, math.inf,
                                 "to the fewest tokens a busy instance must generate within the window, e.g. 1"),
    "vllm_progress_stuck_growth": ("stuck_growth", 0.0, math.inf,
                                   "to how many requests the waiting queue must grow by, with nothing running, "
                                   "to count as stuck, e.g. 1"),
    "vllm_progress_probe_timeout": ("probe_timeout_s", 0.0, MAX_WINDOW_S,
                                    "to the seconds an idle instance may take to answer a 1-token completion, "
                                    "e.g. 15"),
}


class MetricsError(ValueError):
    """An instance's /metrics is missing or unparsable; the message says what (never read as healthy)."""


@dataclass(frozen=True)
class Reading:
    """One /metrics page: requests running and waiting and tokens generated, summed over engines and models;
    kv_usage is the fullest engine's KV cache (0 to 1), None when the page has no such gauge."""

    running: float
    waiting: float
    generated: float
    kv_usage: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"running": self.running, "waiting": self.waiting, "generated": self.generated,
                "kv_usage": self.kv_usage}


def parse_reading(text: str) -> Reading:
    """The reading of one /metrics page; MetricsError naming the missing families when it is not a vLLM page
    (an empty page, an HTML error page, another exporter) or a needed value is not a finite number."""
    sums: dict[str, float] = {}
    kv: float | None = None
    for line in text.splitlines():
        sample = parse_sample(line)
        if sample is None or sample.name not in (*NEEDED, KV_USAGE):
            continue
        if not math.isfinite(sample.value):
            raise MetricsError(f"{sample.name} is {sample.value} (not a finite number)")
        if sample.name == KV_USAGE:
            kv = sample.value if kv is None else max(kv, sample.value)
        else:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    missing = [name for name in NEEDED if name not in sums]
    if len(missing) == len(NEEDED):
        raise MetricsError(f"no vLLM metrics on the page (none of {', '.join(NEEDED)})")
    if missing:
        raise MetricsError(f"the page lacks {', '.join(missing)}")
    return Reading(sums[RUNNING], sums[WAITING], sums[GENERATED], kv)


@dataclass(frozen=True)
class Thresholds:
    """window_s: seconds between the two readings; min_tokens: the fewest tokens a busy instance must generate
    in that window; stuck_growth: by how many requests the waiting queue must grow, nothing running, to be stuck."""

    window_s: float = 5.0
    min_tokens: float = 1
    stuck_growth: float = 1
    # An idle engine answers a 1-token completion in milliseconds on a GPU and within about 2 s on real vLLM's
    # CPU build (docs/progress.md); a hung one never does.
    probe_timeout_s: float = 15.0

    def to_json(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "min_tokens": self.min_tokens, "stuck_growth": self.stuck_growth,
                "probe_timeout_s": self.probe_timeout_s}


def thresholds_of(host: str, hostvars: Mapping[str, Any]) -> Thresholds:
    """The host's thresholds from its inventory variables (VARIABLES), defaults for those unset. Every bad
    value is named at once, as one InventoryError for the host."""
    values: dict[str, float] = {}
    problems: list[tuple[str, str]] = []  # (message, fix)
    for var, (field, low, high, fix) in VARIABLES.items():
        value = coerce(hostvars.get(var), (int, float))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append((f"{var} must be a number, got {type(value).__name__} {value!r}", f"set {var} {fix}"))
        elif not (math.isfinite(value) and low < value <= high):
            bound = f"above {low:g}" + ("" if math.isinf(high) else f" and at most {high:g}")
            problems.append((f"{var} must be {bound}, got {value!r}", f"set {var} {fix}"))
        else:
            values[field] = float(value)
    if len(problems) == 1:
        raise InventoryError(problems[0][0], where=host, hint=problems[0][1])
    if problems:
        raise InventoryError(f"{len(problems)} problems in its progress variables: "
                             + "; ".join(f"{m} ({h})" for m, h in problems),
                             where=host, hint="fix each of them (docs/progress.md), then run again")
    return Thresholds(**values)


@dataclass(frozen=True)
class Progress:
    """The judgement of one instance: state (STATES), the readings quoted as evidence, and the fix when it is
    not healthy. `after` is None when the first reading needed no second one (idle) or could not be read."""

    state: str
    evidence: str
    fix: str | None
    before: Reading | None
    after: Reading | None

    def healthy(self) -> bool:
        return self.state in HEALTHY

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "healthy": self.healthy(), "evidence": self.evidence, "fix": self.fix,
                "before": self.before.to_json() if self.before else None,
                "after": self.after.to_json() if self.after else None}


@dataclass(frozen=True)
class ProbeAnswer:
    """What an idle instance's 1-token completion got: an HTTP status, or why none came (`timed_out`: none within
    the probe's timeout), and how long it took."""

    status: int | None
    error: str | None
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.status is None and self.error is not None and "timed out" in self.error

    def describe(self) -> str:
        if self.status is not None:
            return f"a 1-token completion answered HTTP {self.status} in {self.seconds:.1f} s"
        return f"a 1-token completion got no answer ({self.error})"


def needs_second_reading(before: Reading | MetricsError) -> bool:
    """Whether the instance has work (requests running or waiting), so only a second reading can tell
    whether it makes progress; an idle or unreadable instance is judged from its first reading alone."""
    return isinstance(before, Reading) and (before.running > 0 or before.waiting > 0)


def has_work(text: str, running: str, waiting: str) -> bool:
    """Whether a page shows a sample of the `running` or `waiting` gauge above 0. The host's program
    (remote/programs/progress_read.py) runs this same function, sent as its source, to decide on a second
    reading: so it is plain Python that an old python3 runs, and reads no labels. A sample's value is the first
    word after its labels' closing brace, the line's last `}` (a value or timestamp holds none); a value that is
    no number counts as work, so a doubt costs a wait, never a missed stall."""
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if not brace:
            name, _, rest = line.partition(" ")
        if name.strip() not in (running, waiting):
            continue
        words = (rest.rpartition("}")[2] if brace else rest).split()
        try:
            value = float(words[0])
        except (IndexError, ValueError):
            return True
        if not value <= 0:  # above 0, or NaN
            return True
    return False


def _num(value: float) -> str:
    return f"{value:g}"


def _kv(before: Reading, after: Reading) -> str:
    if after.kv_usage is None:
        return ""
    return f", KV cache {before.kv_usage or 0:.0%}→{after.kv_usage:.0%}"


def judge(before: Reading | MetricsError, after: Reading | MetricsError | None, th: Thresholds, *,
          host: str = "HOST", instance: str = "K", probe: ProbeAnswer | None = None) -> Progress:
    """Judge two readings `th.window_s` apart (`after` None: no second reading was taken, which only an
    instance without work may have: see needs_second_reading). `probe`: what the 1-token completion sent to an
    idle instance got (only its timeout says something: a hung engine; any answer leaves it idle). `host` and
    `instance` (its index or unit name) go into the fix's commands."""
    restart = f"ernie-deploy restart -i INV -l {host} --instance {instance}"
    journal = f"ernie-deploy logs -i INV {host} --instance {instance}"
    for reading, which in ((before, "first"), (after, "second")):
        if isinstance(reading, MetricsError):
            return Progress("unreadable", f"/metrics {which} reading: {reading}",
                            f"check that the instance is up and serves vLLM's /metrics ({journal} shows the "
                            "journal); until it does its progress is unknown",
                            before if isinstance(before, Reading) else None, None)
    assert isinstance(before, Reading)
    if after is None:
        if needs_second_reading(before):
            raise ValueError("an instance with requests running or waiting needs a second reading")
        idle = f"no requests running or waiting (generated {_num(before.generated)} tokens so far)"
        if probe is not None and probe.timed_out:
            return Progress("not-generating", f"{idle}, yet a 1-token completion got no answer within "
                                              f"{_num(th.probe_timeout_s)} s: the engine is hung and its gauges "
                                              "froze at idle",
                            f"restart it: {restart} (or `ernie-deploy watch -i INV -l {host} --restart-stalled`), "
                            f"and read why in the journal: {journal}", before, None)
        return Progress("idle", idle + (f"; {probe.describe()}" if probe is not None else ""), None, before, None)
    assert isinstance(after, Reading)
    window = _num(th.window_s)
    delta = after.generated - before.generated
    evidence = (f"running {_num(before.running)}→{_num(after.running)}, waiting {_num(before.waiting)}→"
                f"{_num(after.waiting)}, generated {_num(before.generated)}→{_num(after.generated)} tokens over "
                f"{window} s{_kv(before, after)}")
    if delta < 0:
        # A counter only goes back when the process restarted between the readings: no evidence of a hang.
        return Progress("ok", evidence + " (the counter restarted: the engine restarted between the readings)",
                        None, before, after)
    if before.running >= 1 and after.running >= 1 and delta < th.min_tokens:
        return Progress("stalled", f"{evidence}: requests are running but fewer than {_num(th.min_tokens)} "
                                   "tokens came out (the engine is hung while /health may still answer 200)",
                        f"restart it: {restart} (or `ernie-deploy watch -i INV -l {host} --restart-stalled`), "
                        f"and read why in the journal: {journal}", before, after)
    if (before.running == 0 and after.running == 0 and after.waiting > 0
            and after.waiting - before.waiting >= th.stuck_growth):
        return Progress("stuck", f"{evidence}: the waiting queue grows while nothing runs (the scheduler "
                                 "admits no request)",
                        f"read why in the journal: {journal} (KV cache full, a request too long for the "
                        f"cache), then restart it: {restart}", before, after)
    if max(before.running, before.waiting, after.running, after.waiting) == 0:
        return Progress("idle", evidence, None, before, after)
    return Progress("ok", evidence, None, before, after)


def progress_check(unit: str, progress: Progress) -> CheckResult:
    """verify's `progress` check of one instance: it passes for ok and idle, fails otherwise (never healthy
    unread), quoting the readings."""
    if progress.healthy():
        what = "makes progress" if progress.state == "ok" else "is idle"
        return CheckResult("progress", "pass", f"{unit} {what}: {progress.evidence}", instance=unit)
    return CheckResult("progress", "fail", f"{unit} is {progress.state}: {progress.evidence}",
                       cause=CAUSES[progress.state], fix=progress.fix, instance=unit)
