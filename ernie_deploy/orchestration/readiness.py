"""Readiness after a (re)start: a pure state machine, and the few lines of I/O around it.

`step(state, observation)` takes what one poll saw (systemd state, new journal lines, the HTTP answers the
host got) and returns a verdict or "wait, and ask this next". Ready means all three agree: the unit runs,
no fatal line appeared, /health is 200, /v1/models lists the served name with the planned max_model_len,
and a small completion works; and all that still holds after a stability window. A known fatal signature
ends the wait at once, not at the budget, and so does a stop someone else asked for (whose shutdown lines
are no fatal signature). `watch` is the loop: build the poll command, run it, step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ernie_deploy.checks import http as judge
from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.checks.signatures import instance_context, intended_stop, scan
from ernie_deploy.orchestration.instancecheck import api_key, request_id, requests_for, serves
from ernie_deploy.orchestration.transport import Transport
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.remote import http
from ernie_deploy.remote.converge import Started
from ernie_deploy.remote.probe import UnitProbe, parse, watch_command


@dataclass
class Readiness:
    status: str  # ready | failed | timeout
    summary: str
    cause: str | None = None
    fix: str | None = None
    evidence: list[str] = field(default_factory=list)
    journal: list[str] = field(default_factory=list)
    seconds: float = 0.0
    healthy_after: float | None = None  # seconds until it first served (loaded); the rest is the stability window


@dataclass(frozen=True)
class Spec:
    unit: str  # the unit's short name (ernie-vllm-0)
    context: dict[str, Any]  # plan values signature fixes may name
    budget: float
    stable: float


@dataclass(frozen=True)
class Observation:
    at: float  # clock reading when the poll returned
    unit: UnitProbe
    health: http.Answer | None  # None: not asked (or the unit is not active)
    serving: bool | None  # None: not asked this poll
    aborted: bool = False


@dataclass
class State:
    started: float
    invocation: str = ""  # the run whose journal was read last (automatic restarts start new runs)
    restarts: int = 0  # NRestarts right after the deploy's own (re)start: only restarts beyond it count
    journal: list[str] = field(default_factory=list)
    cursor: str | None = None
    ready_since: float | None = None


@dataclass(frozen=True)
class Wait:
    ask_serving: bool  # include /v1/models and the smoke completion in the next poll


def step(state: State, obs: Observation, spec: Spec) -> Readiness | Wait:
    """Fold one observation into the state; a verdict, or what to ask on the next poll."""

    def done(status: str, summary: str, **kw: Any) -> Readiness:
        healthy = None if state.ready_since is None else state.ready_since - state.started
        return Readiness(status, summary, journal=state.journal, seconds=obs.at - state.started,
                         healthy_after=healthy, **kw)

    unit = spec.unit
    u = obs.unit
    if u.invocation and u.invocation != state.invocation:  # a new run: its lines were read from its start
        state.invocation, state.cursor = u.invocation, None
    state.journal += u.journal
    state.cursor = u.cursor or state.cursor
    tail = state.journal[-15:]
    fatal = [m for m in scan(state.journal, spec.context) if m.severity == "fail"]
    if fatal:
        m = fatal[0]
        return done("failed", f"{unit}: {m.headline}", cause=m.cause, fix=m.fix, evidence=list(m.lines))
    stop = intended_stop(state.journal)
    if stop is not None:
        # Its shutdown lines are no failure (scan), but a unit being stopped will not become ready either.
        return done("failed", f"{unit} was stopped while the deploy waited for it to become ready",
                    cause=f"a stop was requested ({stop.headline}): `systemctl stop` or restart by someone else, or "
                          "the host shutting down; not a crash", evidence=[stop.line],
                    fix=f"journalctl -u {unit} shows the stop; deploy again once nothing else stops it")
    restarts = u.state.n_restarts - state.restarts
    if restarts >= 2:
        return done("failed", f"{unit} is in a crash loop: systemd restarted it {restarts} times since the deploy",
                    cause="the service dies shortly after starting", evidence=tail,
                    fix=f"journalctl -u {unit} shows each attempt; fix the cause and deploy again")
    if u.state.active_state == "failed":
        return done("failed", f"{unit} failed ({u.state.result})", evidence=tail,
                    cause="the service exited with an error", fix=f"journalctl -u {unit}")
    if u.state.active_state == "active" and obs.health is not None:
        health = judge.classify_health(obs.health.status, obs.health.error)
        if health == "dead":
            return done("failed", f"{unit}: /health answers 503 (engine dead)", evidence=tail,
                        cause="vLLM's engine died after start-up", fix=f"journalctl -u {unit}")
        if health == "ready" and state.ready_since is None and obs.serving:
            state.ready_since = obs.at
        elif health != "ready":
            state.ready_since = None
        if state.ready_since is not None and obs.at - state.ready_since >= spec.stable:
            return done("ready", f"{unit} ready after {obs.at - state.started:.1f}s "
                        f"(still healthy {spec.stable:.0f}s later)")
    if obs.at - state.started >= spec.budget:
        return done("timeout", f"{unit} not ready within the start-up budget of {spec.budget:.0f}s",
                    cause="loading takes longer than the budget, or hangs", evidence=tail,
                    fix="raise vllm_startup_budget if loads are slow; otherwise see the journal lines")
    if obs.aborted:
        return done("failed", f"{unit}: run aborted while waiting")
    return Wait(ask_serving=state.ready_since is None)


# The shortest pause between polls: a host that answers in a few milliseconds is not asked more than ten times a
# second (each poll starts a shell, systemctl, journalctl and the host's python3 for the HTTP requests).
MIN_PAUSE = 0.1


def pause(poll: float, took: float) -> float:
    """Seconds to wait before the next poll: as long as the last one took (a host that answers fast is asked
    again soon, a loaded one is not asked harder), at least MIN_PAUSE and at most `poll`."""
    return min(poll, max(MIN_PAUSE, took))


def watch(session: Transport, plan: HostPlan, inst: InstancePlan, *, started: Started, budget: float,
          stable: float = 3.0, poll: float = 0.5, exp: Expectations | None = None,
          abort: threading.Event | None = None, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep, on_serving: Callable[[], bool] | None = None) -> Readiness:
    """Poll until a verdict. `on_serving` runs once, when the instance first serves (its checks): inside the
    stability window, which goes on meanwhile, instead of after it; False from it ends the watch as failed (it
    said why)."""
    exp = exp or Expectations()
    unit = f"{inst.unit}.service"
    spec = Spec(inst.unit, instance_context(inst, plan.model.num_attention_heads if plan.model else None),
                budget, stable)
    state = State(started=clock(), invocation=started.invocation, restarts=started.restarts)
    ask_serving, checked = True, on_serving is None
    while True:
        asked = clock()
        requests = requests_for(plan, inst, exp, serving=ask_serving)
        probe = parse(session.run(watch_command(unit, invocation=state.invocation, cursor=state.cursor,
                                                requests=requests, api_key=api_key(plan))).text)
        health = http.missing(probe.http, request_id(inst, "health"))
        at = clock()
        verdict = step(state, Observation(at, probe.unit(unit), health,
                                          serves(plan, inst, probe.http) if ask_serving and health else None,
                                          aborted=abort is not None and abort.is_set()), spec)
        if state.ready_since is not None and not checked and (isinstance(verdict, Wait) or verdict.status == "ready"):
            checked = True
            assert on_serving is not None
            if not on_serving():
                return Readiness("failed", f"{inst.unit}: its checks failed once it served", journal=state.journal,
                                 seconds=clock() - state.started, healthy_after=state.ready_since - state.started)
        if isinstance(verdict, Readiness):
            return verdict
        ask_serving = verdict.ask_serving
        wait = pause(poll, at - asked)
        if state.ready_since is not None:  # the window ends between two polls: be there when it does
            wait = min(wait, max(0.0, state.ready_since + stable - clock()))
        sleep(wait)
