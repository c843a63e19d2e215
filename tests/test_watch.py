"""`watch` against scripted hosts: rounds bounded by an injected clock, a stalled instance restarted through the
restart cycle and judged by the next round, the last serving instance of a model never restarted, an unreadable
instance named and never healthy, a failed restart rolled back and reported, the bound on restarts, the JSON
document, the command line's options and the playbook's watch task (the progress reader is scripted here: the
real one is tested with orchestration/progress.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.checks.progress import Progress, Thresholds
from ernie_deploy.errors import ConfigError, DeployError, ExitCode, InventoryError
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration import watch
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.transport import Transport
from ernie_deploy.orchestration.watch import Round, Watcher, WatchOptions, WatchReport, WatchView, restart_options
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.playbook.schema import load_playbook
from ernie_deploy.remote.rolling import Stop

TWO = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}
UNIT0, UNIT1 = "ernie-vllm-0.service", "ernie-vllm-1.service"
FAST = CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01, health_timeout=5.0, stable=0.0)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))


def inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]]) -> Path:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_stable_seconds": 0}, "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def deployed(tmp_path: Path, hosts: dict[str, dict[str, Any]]) -> tuple[dict[str, FakeHost], list[Any]]:
    fakes = {name: FakeHost() for name in hosts}
    selected = list(load_inventory(inventory(tmp_path, hosts)).select(None))
    for r in Runner(PlanContext.load(), connector(fakes), Options(health_timeout=5.0, stable=0.0, poll=0.01)).run(
            selected):
        assert r.status is Status.CHANGED, r.message
    for fake in fakes.values():
        fake.log.clear()
        fake.received.clear()
    return fakes, selected


def progress(state: str) -> Progress:
    fix = None if state in ("ok", "idle") else f"fix for {state}"
    return Progress(state, f"evidence of {state}", fix, None, None)


class Script:
    """A progress reader: each instance's state by (host, unit), as a function of how often the fake host has
    started it (a stall that a restart clears is `{1: "stalled"}`: stalled in its first run, ok after)."""

    def __init__(self, fakes: dict[str, FakeHost], states: dict[tuple[str, str], dict[int, str] | str],
                 clock: Clock | None = None) -> None:
        self.fakes, self.states, self.clock = fakes, states, clock
        self.calls: list[str] = []

    def __call__(self, session: Transport, plan: HostPlan, th: Thresholds) -> dict[str, Progress]:
        self.calls.append(plan.name)
        if self.clock is not None and plan.name == "a":
            self.clock.now += th.window_s  # a real reading waits a window (the hosts' windows overlap)
        out = {}
        for inst in plan.instances:
            spec = self.states.get((plan.name, f"{inst.unit}.service"), "ok")
            runs = self.fakes[plan.name].starts.get(f"{inst.unit}.service", 0)
            state = spec if isinstance(spec, str) else spec.get(runs, "ok")
            if state != "missing":
                out[inst.unit] = progress(state)
        return out


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Recorder(WatchView):
    def __init__(self) -> None:
        self.rounds: list[Round] = []

    def round_done(self, done: Round) -> None:
        self.rounds.append(done)


def watch_run(fakes: dict[str, FakeHost], hosts: list[Any], states: dict[tuple[str, str], dict[int, str] | str], *,
              clock: Clock | None = None, **kw: Any) -> WatchReport:
    clock = clock or Clock()
    options = WatchOptions(**{"seconds": 30.0, "every": 10.0, "restart": restart_options("ernie-deploy watch", FAST),
                              **kw})
    watcher = Watcher(PlanContext.load(), Fleet(connector(fakes), FleetOptions()), options,
                      reader=Script(fakes, states, clock), clock=clock, sleep=clock.sleep)
    return watcher.run(hosts)


def test_rounds_start_every_few_seconds_and_none_after_the_time_is_up(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO, "b": TWO})
    clock = Clock()
    states: dict[tuple[str, str], dict[int, str] | str] = {}
    options = WatchOptions(seconds=30.0, every=10.0)
    view = Recorder()
    script = Script(fakes, states, clock)
    report = Watcher(PlanContext.load(), Fleet(connector(fakes), FleetOptions()), options, reader=script,
                     view=view, clock=clock, sleep=clock.sleep).run(hosts)
    # Rounds at 0, 10 and 20 s; each read takes a 5 s window, the sleep makes up the rest; none at 30 s.
    assert [r.at for r in report.rounds] == [0.0, 10.0, 20.0]
    assert clock.slept == [5.0, 5.0] and clock.now == 1025.0
    assert sorted(script.calls) == ["a", "a", "a", "b", "b", "b"]  # hosts read in every round
    assert view.rounds == report.rounds and report.ended == "time up"
    assert report.code == ExitCode.OK and [r.status for r in report.results] == [Status.OK, Status.OK]
    assert all(len(r.seen) == 4 and not r.sick for r in report.rounds)
    assert not any(f.log for f in fakes.values())  # a watch without --restart-stalled touches nothing


def test_once_reads_one_round_and_a_slow_round_is_not_followed_by_a_late_one(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    assert len(watch_run(fakes, hosts, {}, once=True).rounds) == 1
    clock = Clock()
    # A round that takes longer than `every` is followed at once by the next, never by two at a time.
    report = watch_run(fakes, hosts, {}, clock=clock, seconds=12.0, every=3.0)
    assert [r.at for r in report.rounds] == [0.0, 5.0, 10.0] and clock.slept == [0.0, 0.0]


def test_a_stalled_instance_is_restarted_through_the_cycle_and_the_next_round_sees_it_healthy(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    report = watch_run(fakes, hosts, {("a", UNIT0): {1: "stalled"}}, restart_stalled=True)
    first, second = report.rounds[:2]
    assert [s.state for s in first.sick] == ["stalled"]
    (decision,) = first.decisions
    assert decision.outcome == "restarted" and decision.unit == UNIT0 and "verified" in decision.message
    # Drained, stopped, started, verified: the one instance, never its healthy peer.
    assert fakes["a"].log == [f"stop {UNIT0}", f"start {UNIT0}"]
    assert decision.result is not None and {"drain", "stop", "ready"} <= set(decision.result.timings[UNIT0])
    assert second.at == first.at + 5.0 and not second.sick  # the round that judges it came at once
    assert report.code == ExitCode.OK and report.results[0].status is Status.OK
    # Audited like restart's (the stop's audit record names this command), and the deploy lock released after.
    (stop,) = [c.intent for c in fakes["a"].received if isinstance(c.intent, Stop)]
    assert stop.audit["command"] == "ernie-deploy watch" and stop.audit["action"] == "stop"
    assert fakes["a"].lock_info is None


def test_the_last_serving_instance_of_a_model_is_not_restarted(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": {}})  # one TP-2 instance: the model's only one
    report = watch_run(fakes, hosts, {("a", UNIT0): "stalled"}, restart_stalled=True, once=True)
    (decision,) = report.decisions
    assert decision.outcome == "not-restarted"
    assert decision.message.startswith(f"not restarted: the last serving instance of {decision.model}")
    assert decision.fix is not None and f"--instance {UNIT0}" in decision.fix
    assert fakes["a"].log == [] and report.code == ExitCode.FAILED
    assert "stalled" in report.results[0].message and report.results[0].hint == "fix for stalled"


def test_a_sick_peer_does_not_count_as_serving(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    report = watch_run(fakes, hosts, {("a", UNIT0): "stalled", ("a", UNIT1): "unreadable"}, restart_stalled=True,
                       once=True)
    (decision,) = report.decisions
    assert "last serving instance" in decision.message and fakes["a"].log == []


def test_unreadable_is_named_never_healthy_and_never_restarted(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    report = watch_run(fakes, hosts, {("a", UNIT0): "unreadable", ("a", UNIT1): "missing"}, restart_stalled=True,
                       once=True)
    (only,) = report.rounds
    assert {s.unit: s.state for s in only.sick} == {UNIT0: "unreadable", UNIT1: "unreadable"}
    missing = next(s for s in only.sick if s.unit == UNIT1)
    assert "no progress reading came back" in missing.progress.evidence
    assert not report.decisions and fakes["a"].log == []  # a restart cannot be trusted to fix what is unknown
    assert report.code == ExitCode.FAILED


def test_a_unit_systemd_does_not_run_is_down_not_healthy(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    del fakes["a"].active[UNIT1]
    report = watch_run(fakes, hosts, {("a", UNIT1): "idle"}, once=True)
    assert [(s.unit, s.state) for s in report.rounds[0].sick] == [(UNIT1, "down")]
    assert report.code == ExitCode.FAILED


def test_a_failed_restart_is_reported_and_exits_2(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    fakes["a"].fail_start = "ernie-vllm-0"  # the restarted instance cannot start again
    report = watch_run(fakes, hosts, {("a", UNIT0): {1: "stalled", 2: "unreadable"}}, restart_stalled=True,
                       once=True)
    decision = report.decisions[0]
    assert decision.outcome == "failed" and decision.result is not None
    assert "CUDA out of memory" in decision.message and decision.fix
    # A restart changes no file, so the cycle has no other release to go back to: it stops there, the instance
    # named as it failed, the peer never touched (it served throughout).
    assert fakes["a"].log == [f"stop {UNIT0}", f"start {UNIT0}"] and UNIT1 in fakes["a"].active
    assert [s.state for s in report.rounds[1].sick] == ["unreadable"]  # the judging round: still not healthy
    (end,) = report.results
    assert end.status is Status.FAILED and "the restart of ernie-vllm-0.service failed" in end.message
    assert report.code == ExitCode.FAILED


def test_an_instance_is_restarted_at_most_max_restarts_times(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    report = watch_run(fakes, hosts, {("a", UNIT0): "stalled"}, restart_stalled=True, seconds=20.0)
    outcomes = [d.outcome for d in report.decisions]
    assert outcomes[0] == "restarted" and set(outcomes[1:]) == {"not-restarted"}
    assert "not restarted again: restarted 1 time(s)" in report.decisions[1].message
    assert fakes["a"].log.count(f"start {UNIT0}") == 1
    assert report.code == ExitCode.FAILED  # still stalled at the end


def test_one_restart_per_round_and_the_second_waits_for_the_next(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO, "b": TWO})
    states: dict[tuple[str, str], dict[int, str] | str] = {("a", UNIT0): {1: "stalled"}, ("b", UNIT0): {1: "stuck"}}
    report = watch_run(fakes, hosts, states, restart_stalled=True)
    first = report.rounds[0].decisions
    assert [d.outcome for d in first] == ["restarted", "not-restarted"]
    assert "one restart per round" in first[1].message
    second = report.rounds[1].decisions
    assert [(d.host, d.outcome) for d in second] == [("b", "restarted")]
    assert len(report.rounds) == 3 and not report.rounds[-1].sick and report.code == ExitCode.OK


def test_no_restart_starts_after_the_time_is_up(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    clock = Clock()
    report = watch_run(fakes, hosts, {("a", UNIT0): "stalled"}, clock=clock, restart_stalled=True, seconds=4.0)
    (decision,) = report.decisions  # the round took its 5 s window: the time was up when it ended
    assert decision.message == "not restarted: the watch's time is up" and fakes["a"].log == []


def test_unreachable_host_in_the_last_round_exits_4(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO, "b": TWO})
    fakes["b"].unreachable = True
    report = watch_run(fakes, hosts, {}, once=True)
    assert {r.host: r.status for r in report.results} == {"a": Status.OK, "b": Status.UNREACHABLE}
    assert report.code == ExitCode.UNREACHABLE


def test_a_signal_ends_the_watch_with_the_report_so_far(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    clock = Clock()
    options = WatchOptions(seconds=60.0, every=10.0)
    fleet = Fleet(connector(fakes), FleetOptions())

    def interrupted(seconds: float) -> None:
        fleet.signal = signal.SIGTERM
        fleet.abort.set()

    report = Watcher(PlanContext.load(), fleet, options, reader=Script(fakes, {}, clock), clock=clock,
                     sleep=interrupted).run(hosts)
    assert len(report.rounds) == 1 and report.ended == "interrupted"
    assert report.code == 128 + signal.SIGTERM


def test_bad_bounds_and_thresholds_are_refused_before_any_host(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    for kw, text in (({"seconds": 0.0}, "--for must be above 0"), ({"every": 0.5}, "--every must be at least 1"),
                     ({"seconds": 1e9}, "at most 86400"), ({"max_restarts": 0}, "--max-restarts must be 1 to")):
        with pytest.raises(DeployError, match=text) as err:
            watch_run(fakes, hosts, {}, **kw)
        assert err.value.hint
    bad = list(load_inventory(inventory(tmp_path, {"a": {**TWO, "vllm_progress_window": -1}})).select(None))
    with pytest.raises(InventoryError, match="vllm_progress_window") as err:
        watch_run(fakes, bad, {})
    assert err.value.where == "a" and fakes["a"].received == []


def test_the_json_document_carries_rounds_decisions_and_the_end(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.output.watch import WATCH_SCHEMA, show_end, show_round
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    report = watch_run(fakes, hosts, {("a", UNIT0): {1: "stalled"}}, restart_stalled=True, once=True)
    show_end(report, json=True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == WATCH_SCHEMA == "ernie-deploy/watch/v2" and doc["exit_code"] == 0
    assert doc["ended"] == "once" and doc["restart_stalled"] is True and len(doc["rounds"]) == 2
    (decision,) = doc["rounds"][0]["decisions"]
    assert decision["outcome"] == "restarted" and decision["result"]["status"] == "changed"
    assert {i["unit"]: i["state"] for i in doc["end"]["instances"]} == {UNIT0: "ok", UNIT1: "ok"}
    show_round(report.rounds[0], verbose=False)
    text = capsys.readouterr().out
    assert f"a {UNIT0} (" in text and "stalled: evidence of stalled" in text and "fix: fix for stalled" in text
    assert "restarted:" in text and f"healthy: a {UNIT1} ok" in text


def _parser() -> argparse.ArgumentParser:
    from ernie_deploy.cli.main import _common
    from ernie_deploy.cli.watch import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(), _common)
    return parser


def test_the_command_line_builds_the_watch_and_its_restart(tmp_path: Path) -> None:
    from ernie_deploy.cli.remote import BalancerWiring
    from ernie_deploy.cli.watch import cmd_watch, options_of
    args = _parser().parse_args(["watch", "-i", str(tmp_path / "inv.yml"), "--for", "120", "--every", "15",
                                 "--restart-stalled", "--idle-timeout", "3", "--no-slo-gate"])
    assert args.func is cmd_watch
    opts = options_of(args, BalancerWiring())
    assert (opts.seconds, opts.every, opts.restart_stalled, opts.max_restarts) == (120.0, 15.0, True, 1)
    restart = opts.restart
    assert restart.mode == "restart" and restart.rollout.preflight and restart.cycle.command == "restart"
    assert restart.cycle.idle_timeout == 3.0 and restart.rollout.slo_gate is not None
    assert not restart.rollout.slo_gate.enabled and restart.command == "ernie-deploy watch --restart-stalled"
    defaults = options_of(_parser().parse_args(["watch", "-i", "x.yml"]), BalancerWiring())
    assert (defaults.seconds, defaults.every, defaults.restart_stalled) == (60.0, 10.0, False)
    with pytest.raises(DeployError, match="--for must be above 0"):
        cmd_watch(_parser().parse_args(["watch", "-i", str(tmp_path / "none.yml"), "--for", "0"]))


def test_the_playbook_watch_task_parses_and_bad_keys_are_clear(tmp_path: Path) -> None:
    path = tmp_path / "book.yml"
    path.write_text("- hosts: all\n  tasks:\n    - watch: {for: 120, every: 5, restart_stalled: true}\n")
    (task,) = load_playbook(path).plays[0].tasks
    assert (task.number("for"), task.number("every"), task.flag("restart_stalled")) == (120.0, 5.0, True)
    path.write_text("- hosts: all\n  tasks:\n    - watch: {}\n")
    (task,) = load_playbook(path).plays[0].tasks
    assert (task.number("for"), task.number("every"), task.flag("restart_stalled")) == (60.0, 10.0, False)
    for body, text, hint in (
            ("{restart_staled: true}", r"watch\.restart_staled: unknown argument of watch", "restart_stalled"),
            ("{for: 0}", r"watch\.for: must be above 0", "e.g. 60"),
            ("{every: 0.2}", r"watch\.every: must be at least 1", "e.g. 10"),
            ("{for: yes}", r"watch\.for: expected number", None)):
        path.write_text(f"- hosts: all\n  tasks:\n    - watch: {body}\n")
        with pytest.raises(ConfigError, match=text) as err:
            load_playbook(path)
        assert hint is None or hint in (err.value.hint or "")
        assert "book.yml:3" in str(err.value.where)


def test_a_playbook_watch_task_restarts_and_reports_per_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_deploy.orchestration.playrun import PlaybookRunner, RunOptions
    fakes, _ = deployed(tmp_path, {"a": TWO})
    monkeypatch.setattr(watch, "read_progress", Script(fakes, {("a", UNIT0): {1: "stalled"}}))
    book = tmp_path / "book.yml"
    book.write_text("- hosts: all\n  tasks:\n    - watch: {for: 1, restart_stalled: true}\n")
    runner = PlaybookRunner(load_inventory(tmp_path / "inv.yml"), PlanContext.load(), connector(fakes),
                            RunOptions(base_dir=tmp_path), _no_progress)
    (record,) = runner.run(load_playbook(book))
    (r,) = record.results
    assert r.status is Status.CHANGED, r.message
    assert f"round 1: {UNIT0}: restarted: " in "\n".join(r.evidence)
    assert f"{UNIT0}: ok at the end: evidence of ok" in r.evidence


def _no_progress(play: object, task: object, hosts: object) -> Any:
    from contextlib import nullcontext
    return nullcontext(lambda host, what: None)


def test_the_command_runs_a_watch_and_prints_rounds_then_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.cli import watch as cli
    fakes, _ = deployed(tmp_path, {"a": TWO})
    monkeypatch.setattr(cli, "connector", lambda args: connector(fakes))
    monkeypatch.setattr(watch, "read_progress", Script(fakes, {("a", UNIT1): "stuck"}))
    inv = str(tmp_path / "inv.yml")
    args = _parser().parse_args(["watch", "-i", inv, "--once"])
    assert args.func(args) == ExitCode.FAILED
    text = capsys.readouterr().out
    assert "round 1 at 0s: 2 instance(s) read, 1 healthy, 1 not" in text
    assert f"a {UNIT1} (ERNIE-4.5-0.3B-PT): stuck: evidence of stuck" in text and "fix: fix for stuck" in text
    assert "watch ended (once) after 1 round(s); 0 restart(s)" in text and "exit code 2" in text
    # Its peer serves the model, so it is restarted; a restart does not clear this one, and the round after says so.
    args = _parser().parse_args(["watch", "-i", inv, "--once", "--json", "--restart-stalled", "--no-slo-gate"])
    assert args.func(args) == ExitCode.FAILED
    doc = json.loads(capsys.readouterr().out)
    assert [d["outcome"] for r in doc["rounds"] for d in r["decisions"]] == ["restarted", "not-restarted"]
    assert doc["end"]["hosts"][0]["status"] == "failed" and fakes["a"].log == [f"stop {UNIT1}", f"start {UNIT1}"]


def test_a_signal_during_a_restart_brings_the_instance_back_and_ends_the_watch(tmp_path: Path) -> None:
    from ernie_deploy.remote.rolling import Stop as StopIntent
    fleet_of: list[Fleet] = []

    class SignalOnStop(FakeHost):
        def stop(self, stop: StopIntent) -> str:
            fleet_of[0].signal = signal.SIGINT  # what the fleet's handler does on Ctrl-C
            fleet_of[0].abort.set()
            return super().stop(stop)

    fakes, hosts = deployed(tmp_path, {"a": TWO})
    fakes["a"] = SignalOnStop(**{f.name: getattr(fakes["a"], f.name) for f in dataclasses.fields(FakeHost)})
    fleet = Fleet(connector(fakes), FleetOptions())
    fleet_of.append(fleet)
    clock = Clock()
    options = WatchOptions(seconds=60.0, restart_stalled=True, restart=restart_options("ernie-deploy watch", FAST))
    report = Watcher(PlanContext.load(), fleet, options, reader=Script(fakes, {("a", UNIT0): "stalled"}, clock),
                     clock=clock, sleep=clock.sleep).run(hosts)
    # Stopped when the signal came: started again rather than left down; no round after it.
    assert fakes["a"].log == [f"stop {UNIT0}", f"start {UNIT0}"] and UNIT0 in fakes["a"].active
    assert fakes["a"].lock_info is None
    (decision,) = report.decisions
    assert decision.outcome == "interrupted" and len(report.rounds) == 1
    assert report.ended == "interrupted" and report.code == 128 + signal.SIGINT


def test_a_playbook_watch_task_with_a_bad_threshold_fails_its_hosts_unread(tmp_path: Path) -> None:
    from ernie_deploy.orchestration.playrun import PlaybookRunner, RunOptions
    fakes, _ = deployed(tmp_path, {"a": TWO})
    book = tmp_path / "book.yml"
    book.write_text("- hosts: all\n  vars: {vllm_progress_min_tokens: 0}\n  tasks:\n    - watch: {for: 1}\n")
    runner = PlaybookRunner(load_inventory(tmp_path / "inv.yml"), PlanContext.load(), connector(fakes),
                            RunOptions(base_dir=tmp_path), _no_progress)
    (record,) = runner.run(load_playbook(book))
    (r,) = record.results
    assert r.status is Status.FAILED and r.message.startswith("not watched: a: vllm_progress_min_tokens must be")
    assert r.hint and "vllm_progress_min_tokens" in r.hint and fakes["a"].received == []


def test_the_real_progress_reader_feeds_the_watch(tmp_path: Path) -> None:
    fakes, hosts = deployed(tmp_path, {"a": TWO})
    busy = ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 100.0\n')
    fakes["a"].progress_pages = {"ernie-vllm-0": [busy, busy]}  # requests running, no token between the readings
    clock = Clock()
    options = WatchOptions(seconds=30.0, once=True)
    report = Watcher(PlanContext.load(), Fleet(connector(fakes), FleetOptions()), options, clock=clock,
                     sleep=clock.sleep).run(hosts)
    (sick,) = report.rounds[0].sick
    assert sick.unit == UNIT0 and sick.state == "stalled" and "generated 100→100 tokens" in sick.progress.evidence
    assert [s.state for s in report.rounds[0].seen if s.healthy] == ["idle"]
    assert report.code == ExitCode.FAILED
