"""Readiness watch after a (re)start: systemd state, this start's journal and HTTP, interleaved.

Ready means all three agree: the unit runs, no fatal line appeared, /health is 200, /v1/models lists
the served name with the planned max_model_len, and a small completion works — and all that still
holds after a short stability window. A known fatal signature ends the wait at once, not at the budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ernie_deploy.checks import http as judge
from ernie_deploy.checks.playbook import Expectations
from ernie_deploy.checks.signatures import instance_context, scan
from ernie_deploy.orchestration import httpprobe
from ernie_deploy.orchestration.instancecheck import address_of, api_key
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.remote.probe import parse, unit_script
from ernie_deploy.remote.ssh import RunResult


class Runs(Protocol):
    def run(self, script: str, *, stdin: bytes = b"", timeout: float = 120.0, check: bool = True,
            label: str | None = None) -> RunResult: ...


@dataclass
class Readiness:
    status: str  # ready | failed | timeout
    summary: str
    cause: str | None = None
    fix: str | None = None
    evidence: list[str] = field(default_factory=list)
    journal: list[str] = field(default_factory=list)
    seconds: float = 0.0


def watch(session: Runs, plan: HostPlan, inst: InstancePlan, *, since: str, budget: float, stable: float = 3.0,
          poll: float = 0.5, exp: Expectations | None = None, abort: threading.Event | None = None,
          clock: Callable[[], float] = time.monotonic) -> Readiness:
    unit = f"{inst.unit}.service"
    context = instance_context(inst, plan.model.num_attention_heads if plan.model else None)
    started = clock()
    journal: list[str] = []
    cursor: str | None = None
    first_restarts: int | None = None
    ready_since: float | None = None
    address, key = address_of(plan, inst), api_key(plan)
    exp = exp or Expectations()

    def done(status: str, summary: str, **kw: object) -> Readiness:
        return Readiness(status, summary, journal=journal, seconds=clock() - started, **kw)  # type: ignore[arg-type]

    while True:
        text = session.run(unit_script(unit, since=None if cursor else since, cursor=cursor), check=False,
                           label=f"watch {inst.unit}").text
        state = parse(text)[0].get(unit)
        if state is not None:
            journal += state.journal
            cursor = state.cursor or cursor
            fatal = [m for m in scan(journal, context) if m.severity == "fail"]
            if fatal:
                m = fatal[0]
                return done("failed", f"{inst.unit}: {m.headline}", cause=m.cause, fix=m.fix, evidence=list(m.lines))
            first_restarts = state.restarts if first_restarts is None else first_restarts
            if state.restarts - first_restarts >= 2:
                return done("failed", f"{inst.unit} is in a crash loop: systemd restarted it "
                            f"{state.restarts - first_restarts} times since the deploy",
                            cause="the service dies shortly after starting", evidence=journal[-15:],
                            fix=f"journalctl -u {inst.unit} shows each attempt; fix the cause and deploy again")
            if state.active == "failed":
                return done("failed", f"{inst.unit} failed ({state.result})", evidence=journal[-15:],
                            cause="the service exited with an error", fix=f"journalctl -u {inst.unit}")
            if state.active == "active":
                health, _ = httpprobe.health(address, inst.port)
                if health == "dead":
                    return done("failed", f"{inst.unit}: /health answers 503 (engine dead)", evidence=journal[-15:],
                                cause="vLLM's engine died after start-up", fix=f"journalctl -u {inst.unit}")
                if health == "ready" and ready_since is None and _serves(address, inst, key, exp):
                    ready_since = clock()
                elif health != "ready":
                    ready_since = None
                if ready_since is not None and clock() - ready_since >= stable:
                    return done("ready", f"{inst.unit} ready after {clock() - started:.1f}s "
                                f"(still healthy {stable:.0f}s later)")
        if clock() - started >= budget:
            return done("timeout", f"{inst.unit} not ready within the start-up budget of {budget:.0f}s",
                        cause="loading takes longer than the budget, or hangs", evidence=journal[-15:],
                        fix="raise vllm_startup_budget if loads are slow; otherwise see the journal lines")
        if abort is not None and abort.is_set():
            return done("failed", f"{inst.unit}: run aborted while waiting")
        time.sleep(poll)


def _serves(address: str, inst: InstancePlan, key: str | None, exp: Expectations) -> bool:
    models = httpprobe.models(address, inst.port, key)
    if models.status != 200 or not judge.judge_models(models.body, inst.served_model_name, inst.max_model_len).ok:
        return False
    answer = httpprobe.completion(address, inst.port, inst.served_model_name, key, exp.stream)
    return judge.judge_completion(answer.status or 0, answer.body, inst.served_model_name).ok
