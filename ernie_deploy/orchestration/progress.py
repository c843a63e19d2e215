"""Whether a host's instances make forward progress: one command per host reads every instance's /metrics, waits
the window and reads the busy ones again (remote/programs/progress_read.py, the host's python3), then the pure
judgement (checks/progress.py; docs/progress.md). `status`, `verify` and `watch` read progress through here.

The pages are read on the host, as every HTTP request of an instance is (remote/http.py): the address each
instance is asked on is the one its own host reaches it on (a wildcard bind is loopback), and the API key, when
the host has one, travels on stdin, never on a command line.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ernie_deploy.checks.http import completion_request
from ernie_deploy.checks.progress import (
    GENERATED,
    KV_USAGE,
    RUNNING,
    WAITING,
    MetricsError,
    ProbeAnswer,
    Progress,
    Reading,
    Thresholds,
    judge,
    needs_second_reading,
    parse_reading,
    thresholds_of,
)
from ernie_deploy.errors import InventoryError
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.instancecheck import api_key
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.transport import Transport
from ernie_deploy.planning.hostpaths import local_url
from ernie_deploy.planning.plan import input_errors
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.programs import program
from ernie_deploy.remote.protocol import marker, records

TAG = "progress"
MARK = marker(TAG)
PROGRAM = program("progress_read")
# Seconds one /metrics read may take: vLLM answers it from memory in milliseconds, also while its engine hangs
# (the API server is another process), so a slow answer is itself a sign.
READ_TIMEOUT = 5.0
# Bytes of a page read: a real vLLM 0.32.0 page of one model is about 50 kB (mostly histogram buckets).
BODY_LIMIT = 4 * 1024 * 1024
# Seconds the command may take beyond its reads and window: python3's start and the SSH round trip.
MARGIN = 30.0


@dataclass(frozen=True)
class ReadProgress(Intent):
    """Read the /metrics of `units` at `urls` (in the same order), then, for those with work, again after
    `window_s` seconds."""

    op: ClassVar[Op] = Op.METRICS
    units: tuple[str, ...]
    urls: tuple[str, ...]
    window_s: float

    @property
    def label(self) -> str:
        return f"read progress of {', '.join(self.units)}"

    def render(self) -> str:
        return (f"if command -v python3 >/dev/null; then python3 -c {shlex.quote(PROGRAM)}; "
                f"else printf '{MARK}%s\\n' '{{\"id\": \"*\", \"error\": \"python3 not found on the host\"}}'; fi\n")


def progress_command(plan: HostPlan, th: Thresholds) -> Command:
    """The command for every instance of `plan`; the spec, API key included, on stdin."""
    intent = ReadProgress(tuple(i.unit for i in plan.instances),
                          tuple(f"{local_url(i.host, i.port)}/metrics" for i in plan.instances), th.window_s)
    spec = {"instances": [{"id": i.unit, "url": url, "probe": probe_of(i)}
                          for i, url in zip(plan.instances, intent.urls, strict=True)],
            "api_key": api_key(plan), "window": th.window_s, "timeout": READ_TIMEOUT, "limit": BODY_LIMIT,
            "families": [RUNNING, WAITING, GENERATED, KV_USAGE], "running": RUNNING, "waiting": WAITING,
            "probe_timeout": th.probe_timeout_s, "mark": MARK}
    reads = 2 * len(intent.units) * READ_TIMEOUT
    return Command(intent, stdin=json.dumps(spec).encode(), timeout=max(th.window_s, th.probe_timeout_s) + reads
                   + MARGIN, check=False)


def probe_of(inst: InstancePlan) -> dict[str, Any]:
    """The 1-token completion an idle instance gets: greedy, so it costs one forward pass."""
    body = {**completion_request(inst.served_model_name), "max_tokens": 1}
    return {"url": f"{local_url(inst.host, inst.port)}/v1/completions", "body": body}


def reading_of(answer: dict[str, Any], url: str) -> Reading | MetricsError:
    """One printed reading as the judgement takes it: the page's reading, or what kept it from being one."""
    if answer.get("error"):
        return MetricsError(f"GET {url}: {answer['error']}")
    status = answer.get("status")
    if status != 200:
        return MetricsError(f"GET {url} answered HTTP {status}")
    try:
        return parse_reading(str(answer.get("body") or ""))
    except MetricsError as exc:
        return MetricsError(f"GET {url}: {exc}")


Readings = tuple[Reading | MetricsError, Reading | MetricsError | None, ProbeAnswer | None]


def parse(text: str, intent: ReadProgress) -> dict[str, Readings]:
    """Each unit's first and second reading (None: none was taken) and its probe's answer (None: not probed)
    from what the program printed."""
    rounds: dict[tuple[str, int], dict[str, Any]] = {}
    everything: str | None = None
    for record in records(text, TAG):
        try:
            data = json.loads(record)
            if data.get("id") == "*":
                everything = str(data.get("error"))
            else:
                rounds[(str(data["id"]), int(data["round"]))] = data
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    out: dict[str, Readings] = {}
    for unit, url in zip(intent.units, intent.urls, strict=True):
        first = rounds.get((unit, 1))
        before = reading_of(first, url) if first is not None else MetricsError(
            f"GET {url}: {everything or 'the host printed no reading'}")
        second = rounds.get((unit, 2))
        after: Reading | MetricsError | None = reading_of(second, url) if second is not None else None
        if after is None and needs_second_reading(before):
            after = MetricsError(f"GET {url}: the host took no second reading")
        probed = rounds.get((unit, 0))
        answer = None if probed is None or after is not None else ProbeAnswer(
            probed.get("status") if isinstance(probed.get("status"), int) else None,
            str(probed["error"]) if probed.get("error") else None, float(probed.get("seconds") or 0.0))
        out[unit] = (before, after, answer)
    return out


def read_progress(session: Transport, plan: HostPlan, th: Thresholds) -> dict[str, Progress]:
    """Each instance's progress by unit name, in one command on the host (a wait of th.window_s only when some
    instance has work)."""
    cmd = progress_command(plan, th)
    assert isinstance(cmd.intent, ReadProgress)
    readings = parse(session.run(cmd).text, cmd.intent)
    out = {}
    for inst in plan.instances:
        before, after, answer = readings[inst.unit]
        out[inst.unit] = judge(before, after, th, host=plan.name, instance=str(inst.index), probe=answer)
    return out


def host_thresholds(run: HostRun[Any]) -> Thresholds | None:
    """The host's thresholds, or None with its result failed as a plan error naming the bad variable (before
    anything is read, as any bad input is)."""
    try:
        return thresholds_of(run.host.name, run.host.vars)
    except InventoryError as exc:
        run.result.findings = input_errors(exc)
        run.result.fail(Status.FAILED, "the plan has errors; nothing was touched")
        return None


def read_serving(fleet: Fleet, run: HostRun[Any], plan: HostPlan, instances: Sequence[InstancePlan],
                 th: Thresholds) -> dict[str, Progress]:
    """The progress of `instances` (those of `plan` that serve: one that does not has its own problem named,
    and no /metrics to read), as a step of the host's run; nothing is run when there are none."""
    if not instances:
        return {}
    assert run.session is not None
    fleet.progress(plan.name, "reading progress")
    with fleet.step(run, "progress"):
        return read_progress(run.session, dataclasses.replace(plan, instances=tuple(instances)), th)
