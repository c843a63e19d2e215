"""The readiness state machine, step by step, with an injected clock: no host, no sleeping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ernie_deploy.orchestration import readiness
from ernie_deploy.orchestration.readiness import Observation, Readiness, Spec, State, Wait, step
from ernie_deploy.remote import http as remote_http
from ernie_deploy.remote.converge import Started
from ernie_deploy.remote.http import Answer
from ernie_deploy.remote.probe import UnitProbe
from ernie_deploy.remote.systemd import UnitState

LOGS = Path(__file__).parent / "fixtures" / "logs" / "sim"
SPEC = Spec("ernie-vllm-0", {"unit": "ernie-vllm-0.service", "tensor_parallel_size": 1, "max_model_len": 4096},
            budget=60, stable=3)
REFUSED = Answer(None, b"", "[Errno 111] Connection refused", 0.0)
OK = Answer(200, b"", None, 0.01)


def unit(active: str = "active", restarts: int = 0, journal: list[str] | None = None,
         result: str = "success") -> UnitProbe:
    return UnitProbe(UnitState(name="ernie-vllm-0.service", active_state=active, sub_state="running",
                               n_restarts=restarts, result=result), journal or [])


def obs(at: float, u: UnitProbe, health: Answer | None = OK, serving: bool | None = True,
        aborted: bool = False) -> Observation:
    return Observation(at, u, health, serving, aborted)


def test_ready_only_after_the_stability_window() -> None:
    state = State(started=0)
    assert step(state, obs(1, unit(), REFUSED, None), SPEC) == Wait(ask_serving=True)
    assert step(state, obs(2, unit(), OK, True), SPEC) == Wait(ask_serving=False)  # healthy since 2
    assert step(state, obs(4, unit(), OK, None), SPEC) == Wait(ask_serving=False)
    verdict = step(state, obs(5, unit(), OK, None), SPEC)
    assert isinstance(verdict, Readiness) and verdict.status == "ready" and verdict.seconds == 5


def test_health_lost_inside_the_window_starts_it_again() -> None:
    state = State(started=0)
    step(state, obs(1, unit(), OK, True), SPEC)
    assert step(state, obs(2, unit(), REFUSED, None), SPEC) == Wait(ask_serving=True)
    assert step(state, obs(4.5, unit(), OK, True), SPEC) == Wait(ask_serving=False)
    assert isinstance(step(state, obs(7.5, unit(), OK, None), SPEC), Readiness)


def test_serving_must_be_confirmed_before_the_window_starts() -> None:
    state = State(started=0)
    for t in (1, 2, 3, 4, 5):
        assert step(state, obs(t, unit(), OK, False), SPEC) == Wait(ask_serving=True)


def test_fatal_journal_line_ends_the_wait_at_once() -> None:
    lines = [x for x in (LOGS / "fault-0.34.0-kv_cache.log").read_text().splitlines() if not x.startswith("#")]
    verdict = step(State(started=0), obs(1, unit("activating", journal=lines), None, None), SPEC)
    assert isinstance(verdict, Readiness) and verdict.status == "failed" and verdict.evidence


def test_a_stop_during_the_wait_ends_it_as_a_stop_not_a_crash() -> None:
    """Someone stops the unit while the deploy waits: real vLLM 0.32 logs EngineDeadError tracebacks for the
    requests it aborts; the watch names the stop (at once, not at the budget), not an engine death."""
    real = Path(__file__).parent / "fixtures" / "logs" / "real" / "stop-abort-0.32.log"
    lines = [x for x in real.read_text().splitlines() if not x.startswith("# ")]
    verdict = step(State(started=0), obs(1, unit("deactivating", journal=lines), None, None), SPEC)
    assert isinstance(verdict, Readiness) and verdict.status == "failed"
    assert verdict.summary == "ernie-vllm-0 was stopped while the deploy waited for it to become ready"
    assert verdict.cause is not None and "[shutdown] API server: shutdown triggered" in verdict.cause
    assert "EngineDeadError" not in verdict.summary + verdict.cause
    assert verdict.evidence == [next(x for x in lines if "shutdown triggered" in x)]


def test_crash_loop_counts_restarts_after_the_deploys_own_restart() -> None:
    state = State(started=0, invocation="run-1", restarts=3)  # NRestarts activate printed after its restart
    assert isinstance(step(state, obs(1, unit("activating", restarts=3), None, None), SPEC), Wait)
    assert isinstance(step(state, obs(2, unit("activating", restarts=4), None, None), SPEC), Wait)
    verdict = step(state, obs(3, unit("activating", restarts=5), None, None), SPEC)
    assert isinstance(verdict, Readiness) and "crash loop" in verdict.summary and "2 times" in verdict.summary


def test_a_new_run_is_read_from_its_start_and_old_runs_never_count() -> None:
    """The journal comes per run (InvocationID): the watch follows a new run from its first line and keeps
    the cursor only within one run."""
    state = State(started=0, invocation="run-1")
    first = UnitProbe(UnitState(active_state="active", sub_state="running"), ["loading"], "c1", "run-1")
    assert isinstance(step(state, obs(1, first, REFUSED, None), SPEC), Wait)
    assert (state.invocation, state.cursor) == ("run-1", "c1")
    again = UnitProbe(UnitState(active_state="activating", n_restarts=1), ["starting again"], "c9", "run-2")
    assert isinstance(step(state, obs(2, again, None, None), SPEC), Wait)
    assert (state.invocation, state.cursor, state.journal) == ("run-2", "c9", ["loading", "starting again"])


def test_dead_engine_and_failed_unit() -> None:
    dead = step(State(started=0), obs(1, unit(), Answer(503, b"", None, 0.0), None), SPEC)
    assert isinstance(dead, Readiness) and "503" in dead.summary
    failed = step(State(started=0), obs(1, unit("failed", result="exit-code"), None, None), SPEC)
    assert isinstance(failed, Readiness) and failed.summary == "ernie-vllm-0 failed (exit-code)"


def test_budget_and_abort() -> None:
    timeout = step(State(started=0), obs(60, unit("activating"), None, None), SPEC)
    assert isinstance(timeout, Readiness) and timeout.status == "timeout"
    aborted = step(State(started=0), obs(1, unit("activating"), None, None, aborted=True), SPEC)
    assert isinstance(aborted, Readiness) and aborted.status == "failed" and "aborted" in aborted.summary


def test_a_stopped_unit_is_not_running_never_judged_on_an_old_run() -> None:
    """verify of a stopped unit: the old run's start-up lines must not yield a TP ✓."""
    from ernie_deploy.checks.expectations import Expectations
    from ernie_deploy.inventory.inventory import load_inventory
    from ernie_deploy.orchestration.instancecheck import instance_checks
    from ernie_deploy.planning.plan import PlanContext, plan_host
    from ernie_deploy.remote.probe import HostProbe

    inv = Path(__file__).parent.parent / "inventory" / "example.yml"
    host = next(iter(load_inventory(inv).select("gpu-a10-01.dc1")))
    plan = plan_host(host, PlanContext.load())
    inst = plan.instances[0]
    old = [x for x in (LOGS / "healthy-0.34.0-tp2.log").read_text().splitlines() if not x.startswith("#")]
    stopped = UnitProbe(UnitState(name=f"{inst.unit}.service", active_state="inactive", sub_state="dead"), old)
    checks = instance_checks(plan, inst, HostProbe(units={f"{inst.unit}.service": stopped}), Expectations())
    assert {c.name: c.status for c in checks} == {"systemd": "fail", "startup_log": "fail"}
    assert "not running" in checks[1].summary


def test_a_unit_waiting_to_be_revived_is_a_crash_loop_however_old_its_last_start() -> None:
    from ernie_deploy.orchestration.instancecheck import systemd_check
    from ernie_deploy.planning.plantypes import InstancePlan

    inst = InstancePlan(index=0, unit="ernie-vllm-0", port=8000, host="0.0.0.0", gpus=(0,), served_model_name="m",
                        tensor_parallel_size=1, pipeline_parallel_size=1, max_model_len=None,
                        gpu_memory_utilization=0.9, args=(), memory=None)
    now = 1_000_000_000  # µs on the host's clock; a process started 500 s or 5 s before it
    waiting = UnitState(active_state="activating", sub_state="auto-restart", n_restarts=3,
                        started_monotonic=now - 500_000_000)
    assert systemd_check(inst, waiting, [], now_us=now, stable_s=10).status == "fail"
    assert "crash loop" in systemd_check(inst, waiting, [], now_us=now, stable_s=10).summary
    healed = UnitState(active_state="active", sub_state="running", n_restarts=3, main_pid=7,
                       started_monotonic=now - 500_000_000)
    assert systemd_check(inst, healed, [], now_us=now, stable_s=10).status == "pass"
    fresh = UnitState(active_state="active", sub_state="running", n_restarts=3, main_pid=7,
                      started_monotonic=now - 5_000_000)
    assert systemd_check(inst, fresh, [], now_us=now, stable_s=10).status == "fail"


class _Watched:
    """A host for `watch`: each poll returns the next UnitProbe (health 200 throughout); the clock is advanced by
    the fake sleep and by each poll's `took` seconds; what happened is logged in order."""

    def __init__(self, took: float) -> None:
        self.now, self.took = 0.0, took
        self.log: list[str] = []

    def run(self, command: Any) -> Any:
        self.now += self.took
        self.log.append("poll")
        return SimpleNamespace(text="")

    def sleep(self, seconds: float) -> None:
        self.log.append(f"sleep {seconds:.2f}")
        self.now += seconds


def _watch(monkeypatch: pytest.MonkeyPatch, host: _Watched, on_serving: Callable[[], bool] | None,
           stable: float = 1.0, poll: float = 0.5) -> Readiness:
    probe = SimpleNamespace(http={}, unit=lambda name: unit())
    monkeypatch.setattr(readiness, "parse", lambda text: probe)
    monkeypatch.setattr(readiness, "watch_command", lambda *a, **k: "poll")
    monkeypatch.setattr(readiness, "requests_for", lambda *a, **k: [])
    monkeypatch.setattr(readiness, "api_key", lambda plan: None)
    monkeypatch.setattr(readiness, "instance_context", lambda inst, heads: {})
    monkeypatch.setattr(readiness, "serves", lambda plan, inst, answers: True)
    monkeypatch.setattr(remote_http, "missing", lambda answers, key: OK)
    plan = SimpleNamespace(model=None)
    inst = SimpleNamespace(unit="ernie-vllm-0")
    return readiness.watch(host, plan, inst, started=Started("run-1", 0), budget=60,  # type: ignore[arg-type]
                           stable=stable, poll=poll, clock=lambda: host.now, sleep=host.sleep,
                           on_serving=on_serving)


def test_checks_run_once_inside_the_stability_window_and_the_window_ends_on_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    host = _Watched(took=0.05)

    def checks() -> bool:
        host.log.append("checks")
        host.now += 0.4  # the checks take their time; the window goes on meanwhile
        return True

    ready = _watch(monkeypatch, host, checks, stable=1.0)
    assert ready.status == "ready"
    assert host.log.count("checks") == 1 and host.log.index("checks") == 1  # right after the first serving poll
    # Served at 0.05 s: the window ends at 1.05 s, and the last poll is there, not a full poll interval later.
    assert ready.seconds == pytest.approx(1.05, abs=0.06)


def test_failed_checks_end_the_watch_before_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _Watched(took=0.05)
    ready = _watch(monkeypatch, host, lambda: False, stable=5.0)
    assert ready.status == "failed" and "checks failed" in ready.summary
    assert host.log == ["poll"] and ready.healthy_after == pytest.approx(0.05)


def test_a_host_that_answers_fast_is_polled_sooner_but_never_harder_than_the_floor() -> None:
    assert readiness.pause(0.5, 0.02) == readiness.MIN_PAUSE
    assert readiness.pause(0.5, 0.2) == 0.2
    assert readiness.pause(0.5, 3.0) == 0.5
    assert readiness.pause(0.01, 0.2) == 0.01  # a caller's shorter poll (tests) wins
