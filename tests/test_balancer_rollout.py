"""Rollouts that drive the fleet's balancers, against scripted hosts and a scripted balancer control: the order
of drain, idle wait, hooks, stop, start, ready and UP; every path that puts an instance back (a stopped rollout,
Ctrl-C, SIGTERM, a verified rollback, --resume) sets it ready; problems stop the rollout before any stop; deploy
applies the balancers' configuration before any instance changes. The lab runs the same against real HAProxy
(tests/lab/test_lab_balancer.py)."""

from __future__ import annotations

import _thread
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.balancers import AdminState, ServerStat
from ernie_deploy.orchestration.cycle import CycleOptions, up_timeout
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.restart import Restarter, RestartOptions
from ernie_deploy.orchestration.results import HostResult, Status, exit_code
from ernie_deploy.orchestration.rollout import RolloutOptions
from ernie_deploy.planning.balancer import BalancerPlan, plan_balancers
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.remote.balancer import Applied
from ernie_deploy.remote.lock import LockInfo

TWO = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}
FAST: dict[str, Any] = {"health_timeout": 5.0, "stable": 0.0, "poll": 0.01}
HOOK = "printf '%s %s\\n' \"$ERNIE_HOOK\" \"$ERNIE_UNIT\" >> {log}"


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "rollouts"
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(path))
    return path


class Journal(list[str]):
    """A host's log that also appends each line to a file, where hooks write theirs: one order for all."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def append(self, line: str) -> None:
        super().append(line)
        with self.path.open("a") as fh:
            fh.write(line + "\n")


@dataclass
class FakeControl:
    """A BalancerControl with scripted answers. It fronts every instance on `balancers`; each call is written
    to the log of the vLLM host it concerns ("lb drain a-0", "lb idle a-0" once it reports no session, "lb ready
    a-0", "lb up a-0" once it reports it UP), in order with the fake host's own stops and starts."""

    logs: dict[str, list[str]]
    balancers: tuple[str, ...] = ("lb-1",)
    sessions: list[int] = field(default_factory=list)  # scur answers in turn while drained, then 0
    up_after: int | None = 1  # reads after ready before UP (None: never: its health check fails)
    refuse: dict[str, str] = field(default_factory=dict)  # "drain"/"ready" → the problem (of the last balancer)
    down: list[str] = field(default_factory=list)  # unreachable()'s problems
    on_stats: Callable[[], None] = lambda: None
    state: dict[str, str] = field(default_factory=dict)  # server → drain | ready (absent: ready)
    reads: dict[str, int] = field(default_factory=dict)  # server → stats reads since it was set ready
    calls: list[str] = field(default_factory=list)

    def fronting(self, host: str, index: int) -> list[str]:
        return list(self.balancers)

    def set_state(self, host: str, index: int, state: AdminState) -> list[str]:
        server = f"{host}-{index}"
        self.logs[host].append(f"lb {state} {server}")
        self.calls.append(f"{state} {server}")
        problem = self.refuse.get(state)
        self.state[server] = state  # the first balancers took it; a refused one is the last
        self.reads[server] = 0
        return [f"{self.balancers[-1]}: {problem}"] if problem else []

    def stats(self, host: str, index: int) -> tuple[dict[str, ServerStat], list[str]]:
        self.on_stats()
        server = f"{host}-{index}"
        if self.state.get(server) == "drain":
            scur = self.sessions.pop(0) if self.sessions else 0
            if scur == 0 and f"lb idle {server}" not in self.logs[host]:
                self.logs[host].append(f"lb idle {server}")
            return {b: ServerStat("DRAIN", scur, 1) for b in self.balancers}, []
        self.reads[server] = self.reads.get(server, 0) + 1
        up = self.up_after is not None and self.reads[server] > self.up_after
        if up and f"lb up {server}" not in self.logs[host][-1:]:
            self.logs[host].append(f"lb up {server}")
        return {b: ServerStat("UP" if up else "DOWN 1/2", 0, 1) for b in self.balancers}, []

    def unreachable(self) -> list[str]:
        return list(self.down)


def inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]], balancer: dict[str, Any] | None = None) -> Path:
    """vLLM hosts at 127.0.0.11, .12, ... (each instance where the balancer reaches it), lb-1 at 127.0.0.9."""
    own = {name: {"ansible_host": f"127.0.0.{11 + k}", **values} for k, (name, values) in enumerate(hosts.items())}
    data: dict[str, Any] = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "vllm_host": "0.0.0.0"},
                                    "hosts": own, "children": {"vllm_balancers": {"hosts": {
                                        "lb-1": {"ansible_host": "127.0.0.9", **(balancer or {})}}}}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def setup(tmp_path: Path, hosts: dict[str, dict[str, Any]]) -> tuple[list[Any], list[BalancerPlan]]:
    """The inventory's vLLM hosts, and its balancer's plan (lb-1, fronting every instance)."""
    from ernie_deploy.planning.balancer import split_hosts

    inv = load_inventory(inventory(tmp_path, hosts))
    vllm, lbs = split_hosts(list(inv.select(None)))
    return vllm, plan_balancers(lbs, plan_hosts(list(vllm), PlanContext.load()))


def cycle(control: FakeControl | None, plans: list[BalancerPlan], **kw: Any) -> CycleOptions:
    return CycleOptions(**{"idle_timeout": 2.0, "gpu_timeout": 0.3, "poll": 0.01, "balancers": control,
                           "balancer_plans": tuple(plans), "balancer_poll": 0.01, "balancer_up_timeout": 2.0,
                           **kw})


def deploy(fakes: dict[str, FakeHost], hosts: list[Any], opts: CycleOptions | None = None,
           **kw: Any) -> tuple[Runner, list[HostResult]]:
    runner = Runner(PlanContext.load(), connector(fakes), Options(**FAST, cycle=opts or CycleOptions(), **kw))
    return runner, runner.run(hosts)


def restart(fakes: dict[str, FakeHost], hosts: list[Any], opts: CycleOptions,
            rollout: RolloutOptions | None = None) -> tuple[Restarter, list[HostResult]]:
    options = RestartOptions(cycle=dataclasses_replace(opts, command="restart", health_timeout=5.0, stable=0.0),
                             rollout=rollout or RolloutOptions(serial=[1], preflight=True, resume_key="k",
                                                               balancer_hosts=("lb-1",)))
    runner = Restarter(PlanContext.load(), connector(fakes), options)
    return runner, runner.run(hosts)


def dataclasses_replace(opts: CycleOptions, **kw: Any) -> CycleOptions:
    import dataclasses

    return dataclasses.replace(opts, **kw)


def served(tmp_path: Path, names: str, vars_: dict[str, Any] | None = None) -> tuple[
        dict[str, FakeHost], list[Any], list[BalancerPlan], FakeControl]:
    """Hosts deployed and serving, their logs cleared (and teed to tmp_path/NAME.log), and a control."""
    fakes = {h: FakeHost() for h in names}
    hosts, plans = setup(tmp_path, {h: dict(vars_ or {}) for h in names})
    deploy(fakes, hosts)
    for name, fake in fakes.items():
        fake.log = Journal(tmp_path / f"{name}.log")
    return fakes, hosts, plans, FakeControl({h: f.log for h, f in fakes.items()})


def test_each_instance_is_drained_idle_then_stopped_and_up_before_the_next_goes(tmp_path: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "a", TWO)
    lb.sessions = [2, 1, 0]
    hook = HOOK.format(log=tmp_path / "a.log")
    runner, (r,) = restart(fakes, hosts, cycle(lb, plans, pre_drain=hook, post_ready=hook))
    assert r.status is Status.CHANGED, r.message
    assert (tmp_path / "a.log").read_text().splitlines() == [
        "lb drain a-0", "lb idle a-0", "pre-drain ernie-vllm-0.service", "stop ernie-vllm-0.service",
        "start ernie-vllm-0.service", "lb ready a-0", "lb up a-0", "post-ready ernie-vllm-0.service",
        "lb drain a-1", "lb idle a-1", "pre-drain ernie-vllm-1.service", "stop ernie-vllm-1.service",
        "start ernie-vllm-1.service", "lb ready a-1", "lb up a-1", "post-ready ernie-vllm-1.service"]
    assert lb.state == {"a-0": "ready", "a-1": "ready"}
    # The waits are phases: steps (JSON) and timeline spans.
    (idle,) = [s for s in r.steps if s.name == "balancer drain ernie-vllm-0"]
    assert idle.status == "ok" and "no session on lb-1" in idle.evidence[0]
    phases = [s.phase for s in runner.report.timeline.spans if s.row == "a ernie-vllm-0.service"]
    assert phases == ["balancer", "hook", "drain", "stop", "gpu-release", "load", "ready", "balancer", "hook"]
    assert runner.report.rotation.snapshot() == {} and runner.report.driven


def test_without_hooks_the_balancer_alone_is_recorded_and_a_new_instance_is_left_to_its_checks(
        tmp_path: Path, state_dir: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "a")
    seen: list[dict[str, Any]] = []
    lb.on_stats = lambda: seen.append(json.loads(next(state_dir.glob("*.json")).read_text())["out"])
    _, (r,) = restart(fakes, hosts, cycle(lb, plans))
    assert r.status is Status.CHANGED, r.message
    assert seen[0] == {"a": ["ernie-vllm-0.service"]}  # recorded before it was drained
    assert not list(state_dir.glob("*.json"))  # back: nothing to resume
    # A first start drains nothing: nothing served before, no capacity is owed.
    fresh = {"b": FakeHost()}
    lb2 = FakeControl({"b": fresh["b"].log})
    hosts, plans = setup(tmp_path, {"b": {}})
    _, (r,) = deploy(fresh, hosts, cycle(lb2, plans))
    assert r.status is Status.CHANGED and lb2.calls == [], r.message


def test_a_drain_the_balancer_refuses_stops_before_any_stop_and_readies_what_drained(tmp_path: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "ab")
    lb.balancers = ("lb-1", "lb-2")
    lb.refuse = {"drain": "HAProxy refused `set server vllm/a-0 state drain`: No such server."}
    runner, (a, b) = restart(fakes, hosts, cycle(lb, plans))
    assert a.status is Status.FAILED and "lb-2" in a.message and "No such server" in a.message, a.message
    assert a.hint and "--no-balancer" in a.hint
    assert fakes["a"].log == ["lb drain a-0", "lb ready a-0"] and fakes["b"].log == []
    assert "ernie-vllm-0.service" in fakes["a"].active and lb.state == {"a-0": "ready"}
    assert b.status is Status.SKIPPED and runner.report.rotation.snapshot() == {}


def test_a_failed_pre_drain_hook_sets_the_drained_instance_ready_and_parallel_instances_drain_together(
        tmp_path: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "a", TWO)
    _, (r,) = restart(fakes, hosts, cycle(lb, plans, pre_drain="exit 1"))
    assert r.status is Status.FAILED and "pre-drain hook exited 1" in r.message
    assert fakes["a"].log == ["lb drain a-0", "lb idle a-0", "lb ready a-0"]
    assert lb.state == {"a-0": "ready"} and "ernie-vllm-0.service" in fakes["a"].active
    # A host whose instances go at once: every one drained before the wait on any.
    fakes["a"].log.clear()
    _, (r,) = restart(fakes, hosts, cycle(lb, plans, parallel_instances=True))
    assert r.status is Status.CHANGED, r.message
    assert fakes["a"].log[:4] == ["lb drain a-0", "lb drain a-1", "lb idle a-0", "lb idle a-1"]
    assert fakes["a"].log[-4:] == ["lb ready a-0", "lb up a-0", "lb ready a-1", "lb up a-1"]


def test_a_balancer_that_cannot_be_driven_refuses_the_rollout_naming_it(tmp_path: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "ab")
    lb.down = ["lb-1: 127.0.0.9:22: connection refused (fix: check that lb-1 runs sshd)"]
    runner, results = restart(fakes, hosts, cycle(lb, plans))
    assert [r.status for r in results] == [Status.FAILED, Status.FAILED]
    assert "refused to start the rollout" in results[0].message and "lb-1" in results[0].message
    assert results[0].hint and "--no-balancer" in results[0].hint
    assert runner.report.balancer_problems == lb.down and exit_code(results) == ExitCode.FAILED
    assert fakes["a"].log == [] and fakes["b"].log == [] and lb.calls == []
    # With nothing to restart there is nothing to refuse.
    _, (r,) = deploy({"a": fakes["a"]}, hosts[:1], cycle(lb, plans))
    assert r.status is Status.OK, r.message


def test_a_server_the_balancer_never_sees_up_fails_naming_it_and_keeps_the_instance(tmp_path: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "ab")
    lb.up_after = None
    hook = HOOK.format(log=tmp_path / "a.log")
    runner, (a, b) = restart(fakes, hosts, cycle(lb, plans, pre_drain=hook, post_ready=hook,
                                                 balancer_up_timeout=0.2))
    assert a.status is Status.FAILED
    assert "lb-1: server" in a.message and "/a-0 is DOWN 1/2" in a.message, a.message
    assert a.hint and "127.0.0.11:8000" in a.hint and "health check" in a.hint
    lines = (tmp_path / "a.log").read_text().splitlines()
    assert lines[-3:] == ["start ernie-vllm-0.service", "lb ready a-0", "post-ready ernie-vllm-0.service"]
    assert not [x for x in lines if x.startswith("undo")] and "ernie-vllm-0.service" in fakes["a"].active
    assert b.status is Status.SKIPPED and runner.report.rotation.snapshot() == {}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_balancer_drains_puts_the_instance_back_unstopped(tmp_path: Path, sig: int) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "ab")
    lb.sessions = [3] * 1000

    def stop() -> None:
        if lb.calls == ["drain a-0"]:
            lb.calls.append("signal")
            if sig == signal.SIGINT:
                _thread.interrupt_main()  # what Ctrl-C does
            else:
                os.kill(os.getpid(), sig)
            time.sleep(0.2)

    lb.on_stats = stop
    runner, (a, b) = restart(fakes, hosts, cycle(lb, plans))
    assert runner.stopped_by == sig
    assert fakes["a"].log == ["lb drain a-0", "lb ready a-0"] and lb.state == {"a-0": "ready"}
    assert a.status is Status.FAILED and "interrupted" in a.message and b.status is Status.SKIPPED
    assert runner.report.rotation.snapshot() == {}


def test_a_verified_rollback_is_set_ready_and_one_that_does_not_serve_stays_drained_and_named(
        tmp_path: Path, state_dir: Path) -> None:
    fakes, hosts, plans, lb = served(tmp_path, "a")
    fakes["a"].fail_start = "--max-model-len 2048"
    hosts2, _ = setup(tmp_path, {"a": {"vllm_max_model_len": 2048}})
    _, (r,) = deploy(fakes, hosts2, cycle(lb, plans), rollout=RolloutOptions(resume_key="k"))
    assert r.status is Status.FAILED
    assert fakes["a"].log[-3:] == ["undo ernie-vllm-0.service", "start ernie-vllm-0.service", "lb ready a-0"]
    (line,) = r.change.rollbacks
    assert "ready and verified; back in the load balancer (set ready on its balancer)" in line, line
    assert lb.state == {"a-0": "ready"} and not [c for c in r.checks if c.name == "rotation"]
    # Every start fails now: the restored instance does not serve either, so it stays drained and named.
    fakes["a"].fail_start = "vllm"
    fakes["a"].log.clear()
    _, (r,) = restart(fakes, hosts, cycle(lb, plans))
    assert r.status is Status.FAILED and lb.state == {"a-0": "drain"}
    (named,) = [c for c in r.checks if c.name == "rotation"]
    assert "out of the load balancer" in named.summary and named.fix and "--resume" in named.fix
    assert json.loads((state_dir / "k.json").read_text())["out"] == {"a": ["ernie-vllm-0.service"]}
    # Repaired by hand; --resume sets it ready first, once it serves.
    fakes["a"].fail_start = None
    fakes["a"].active["ernie-vllm-0.service"] = 99
    fakes["a"].log.clear()
    runner, (r,) = restart(fakes, hosts, cycle(lb, plans), RolloutOptions(
        serial=[1], preflight=True, resume_key="k", resume=True, command="restart"))
    assert r.status is Status.CHANGED, r.message
    assert fakes["a"].log[0] == "lb ready a-0" and lb.state == {"a-0": "ready"}
    assert runner.report.rotation.snapshot() == {} and not list(state_dir.glob("*.json"))


def test_resume_leaves_it_recorded_when_the_balancer_refuses_ready(tmp_path: Path) -> None:
    from ernie_deploy.orchestration import resume

    fakes, hosts, plans, lb = served(tmp_path, "a")
    resume.save(resume.RolloutState("k", "restart", [["a"]], out={"a": ["ernie-vllm-0.service"]}))
    lb.refuse = {"ready": "HAProxy's runtime API did not answer on /run/haproxy/admin.sock: timeout"}
    runner, (r,) = restart(fakes, hosts, cycle(lb, plans), RolloutOptions(
        serial=[1], preflight=True, resume_key="k", resume=True, command="restart"))
    assert lb.calls[0] == "ready a-0"
    assert any("still drained on its balancer" in e and "lb-1" in e for e in r.evidence), r.evidence
    assert "ernie-vllm-0.service" in runner.report.rotation.out_of("a")


def test_no_balancer_drives_nothing_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.output.remote import show_outcome

    fakes, hosts, plans, lb = served(tmp_path, "a")
    runner, results = restart(fakes, hosts, cycle(None, plans))
    assert [r.status for r in results] == [Status.CHANGED] and lb.calls == []
    assert fakes["a"].log == ["stop ernie-vllm-0.service", "start ernie-vllm-0.service"]
    assert runner.report.balancers == ("lb-1",) and not runner.report.driven
    show_outcome("restart", results, 0, runner.report, json=False, check=False, verbose=0)
    assert "--no-balancer: the balancers (lb-1) were not driven" in capsys.readouterr().out
    show_outcome("restart", results, 0, runner.report, json=True, check=False, verbose=0)
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ernie-deploy/deploy/v5"
    assert doc["rollout"]["balancers"] == {"hosts": ["lb-1"], "driven": False, "refused": []}


@dataclass
class FakeSetup:
    """What deploy asks of the selected balancers: apply (scripted), and their results."""

    fakes: dict[str, FakeHost]
    answer: Applied
    plan: BalancerPlan
    calls: list[tuple[bool, int, str]] = field(default_factory=list)  # (check, commands hosts had, config)

    def apply(self, render: Callable[[BalancerPlan], str], *, who: LockInfo | None = None,
              check: bool = False) -> dict[str, Applied]:
        touched = sum(len(f.received) for f in self.fakes.values())
        self.calls.append((check, touched, render(self.plan)))
        return {"lb-1": self.answer}

    def results(self) -> list[HostResult]:
        return [HostResult("lb-1")]


def test_deploy_applies_the_balancer_first_and_a_failed_apply_leaves_every_instance_untouched(
        tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    hosts, plans = setup(tmp_path, {"a": {}})
    ok = FakeSetup(fakes, Applied("lb-1", changed=True, started=True), plans[0])
    _, results = deploy(fakes, hosts, balancer_setup=ok, render_balancer=lambda p: f"config of {p.host}")
    assert [(r.host, r.status) for r in results] == [("lb-1", Status.CHANGED), ("a", Status.CHANGED)]
    assert results[0].message == "balancer: HAProxy configuration changed, started"
    assert ok.calls == [(False, 0, "config of lb-1")]  # before any command reached a vLLM host
    # A configuration haproxy -c rejects: nothing else happens, haproxy's words are quoted, exit 2.
    quoted = "[ALERT]    (1) : config : parsing [/etc/haproxy/haproxy.cfg.ernie-new:12] : unknown keyword 'bogus'"
    bad = FakeSetup(fakes, Applied("lb-1", error="the configuration fails `haproxy -c`, nothing was changed:\n"
                                   + quoted, hint="fix the template"), plans[0])
    before = len(fakes["a"].received)
    hosts2, _ = setup(tmp_path, {"a": {"vllm_max_model_len": 2048}})
    _, (lb_result, a) = deploy(fakes, hosts2, balancer_setup=bad, render_balancer=lambda p: "x")
    assert lb_result.status is Status.FAILED and "fails `haproxy -c`" in lb_result.message
    assert lb_result.evidence == [quoted] and lb_result.hint == "fix the template"
    assert a.status is Status.SKIPPED and "balancer lb-1" in a.message
    assert len(fakes["a"].received) == before and exit_code([lb_result, a]) == ExitCode.FAILED
    # Check mode asks what would change.
    would = FakeSetup(fakes, Applied("lb-1", changed=True, check=True), plans[0])
    _, (lb_result, a) = deploy(fakes, hosts2, balancer_setup=would, render_balancer=lambda p: "x", check=True)
    assert would.calls[0][0] is True and lb_result.status is Status.CHANGED
    assert "would be changed" in lb_result.message and "check mode" in lb_result.message
    assert a.status is Status.CHANGED and "would change" in a.message
    # In check mode a failing balancer does not hide what the hosts would do.
    bad.answer = Applied("lb-1", check=True, error="lb-1: unreachable: 127.0.0.9:22: connection refused")
    _, (lb_result, a) = deploy(fakes, hosts2, balancer_setup=bad, render_balancer=lambda p: "x", check=True)
    assert lb_result.status is Status.FAILED and a.status is Status.CHANGED, a.message
    assert "2048" not in fakes["a"].files["/etc/systemd/system/ernie-vllm-0.service"]


def test_up_timeout_follows_the_check_interval() -> None:
    assert up_timeout(2.0) == 13.0 and up_timeout(1.0) == 9.0


def test_the_command_line_keeps_balancers_out_of_vllm_hosts_and_plans_them_from_the_whole_inventory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from ernie_deploy.cli.main import build_parser, main
    from ernie_deploy.cli.remote import balancers, selected, targets

    path = inventory(tmp_path, {"a": {"ansible_port": 1}, "b": {"ansible_port": 1}})
    args = build_parser().parse_args(["restart", "-i", str(path), "--limit", "a"])
    inv, ctx, hosts = targets(args)
    assert [h.name for h in hosts] == ["a"]
    assert [h.name for h in targets(build_parser().parse_args(["verify", "-i", str(path)]))[2]] == ["a", "b"]
    assert [h.name for h in selected(build_parser().parse_args(["lock", "-i", str(path), "--show"]))[2]] == \
        ["a", "b", "lb-1"]
    assert main(["restart", "-i", str(path), "--limit", "lb-1"]) == ExitCode.INPUT
    assert "selects only balancer hosts (lb-1" in capsys.readouterr().err
    with balancers(args, inv, ctx) as lb:
        assert lb.names == ("lb-1",) and lb.control is not None and lb.setup is None
        (plan,) = lb.plans
        assert [s.name for _, s in plan.servers()] == ["a-0", "b-0"]  # b too, though --limit a
    with balancers(argparse.Namespace(**{**vars(args), "no_balancer": True}), inv, ctx) as lb:
        assert lb.names == ("lb-1",) and lb.control is None and lb.plans == ()
    # A vLLM host that does not plan makes the balancer unplannable: exit 5 before any host is contacted.
    path = inventory(tmp_path, {"a": {"ansible_port": 1}, "b": {"ansible_port": 1, "gpu_model": "nope"}})
    rc = main(["restart", "-i", str(path), "--limit", "a"])
    err = capsys.readouterr().err
    assert rc == ExitCode.INPUT and "b: the plan has errors, so the balancers" in err, err
    assert "leave the host out of the inventory" in err
    # --no-balancer does not even plan them: a restart of the good host goes on (here: to its unreachable SSH).
    rc = main(["restart", "-i", str(path), "--limit", "a", "--no-balancer"])
    assert rc == ExitCode.UNREACHABLE, capsys.readouterr()


@pytest.mark.parametrize("command", ["deploy", "restart", "rollback"])
def test_help_says_when_to_use_no_balancer(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.cli.main import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-balancer" in text and "down" in text and "requests" in text and "lost" in text


def test_the_commands_apply_and_drive_haproxy_through_the_balancers_ssh_door(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """deploy, restart and deploy --limit through the command line, with orchestration/balancers.py's Balancers
    talking to a scripted HAProxy on lb-1 over the same (fake) SSH door as the vLLM hosts."""
    from fakehost import FakeBalancer

    from ernie_deploy.cli.main import main

    haproxy = FakeBalancer(running=False)
    fakes = {"a": FakeHost(), "b": FakeHost(), "lb-1": FakeHost(balancer=haproxy)}
    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connector(fakes))
    fast = {"vllm_stable_seconds": 0}
    path = inventory(tmp_path, {"a": fast, "b": fast})
    assert main(["deploy", "-i", str(path), "--json"]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert [(h["host"], h["status"]) for h in doc["hosts"]] == [("lb-1", "changed"), ("a", "changed"),
                                                                 ("b", "changed")]
    assert doc["hosts"][0]["message"] == "balancer: HAProxy configuration changed, started"
    assert haproxy.log == ["started"] and sorted(s.strip("\"") for _, s in haproxy.servers) == ["a-0", "b-0"]
    assert doc["rollout"]["balancers"] == {"hosts": ["lb-1"], "driven": True, "refused": []}
    # A restart of a alone drives the runtime API for a's instance; b and the configuration are left alone.
    assert main(["restart", "-i", str(path), "--limit", "a"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert [x.rpartition("/")[2] for x in haproxy.log[1:]] == ["a-0 drain", "a-0 ready"], (haproxy.log, out)
    assert all(s.status == "UP" for s in haproxy.servers.values())
    # deploy --limit of a vLLM host applies no configuration; --limit lb-1 applies only it (unchanged now).
    assert main(["deploy", "-i", str(path), "--limit", "a", "--json"]) == ExitCode.OK
    assert [h["host"] for h in json.loads(capsys.readouterr().out)["hosts"]] == ["a"]
    assert main(["deploy", "-i", str(path), "--limit", "lb-1", "--json"]) == ExitCode.OK
    (only,) = json.loads(capsys.readouterr().out)["hosts"]
    assert (only["host"], only["status"], only["message"]) == ("lb-1", "ok", "balancer: HAProxy configuration "
                                                                               "unchanged")
    # A template that fails `haproxy -c`: nothing reloaded, haproxy quoted, no instance touched, exit 2.
    haproxy.invalid = "vllm"
    received = len(fakes["a"].received)
    changed = inventory(tmp_path, {"a": {**fast, "vllm_max_model_len": 2048}, "b": fast})
    assert main(["deploy", "-i", str(changed)]) == ExitCode.FAILED
    out = " ".join(capsys.readouterr().out.split())
    assert "fails `haproxy -c`" in out and "unknown keyword 'vllm'" in out, out
    assert haproxy.log[-1].endswith("a-0 ready") and len(fakes["a"].received) == received
    # status puts lb-1's view of each server beside the instance's own (a serving one in DRAIN is drift); a host
    # that does not plan any more leaves the balancers unread (named in a warning) but every host reported.
    monkeypatch.setattr("ernie_deploy.cli.status.connector", lambda args: connector(fakes))
    capsys.readouterr()
    path = inventory(tmp_path, {"a": fast, "b": fast})
    haproxy.servers[("ERNIE-4.5-0.3B-PT", "b-0")].status = "DRAIN"
    assert main(["status", "-i", str(path), "--json"]) == ExitCode.FAILED  # 2: drift
    doc = json.loads(capsys.readouterr().out)
    seen = {h: [(i["unit"], i["balancers"]["lb-1"]["status"]) for i in doc["hosts"][h]["instances"]] for h in "ab"}
    assert seen == {"a": [("ernie-vllm-0.service", "UP")], "b": [("ernie-vllm-0.service", "DRAIN")]}
    assert [d["kind"] for d in doc["hosts"]["a"]["drift"]] == []
    assert [d["kind"] for d in doc["hosts"]["b"]["drift"]] == ["balancer"]
    assert (doc["balancers"]["lb-1"]["planned"], doc["balancers"]["lb-1"]["up"]) == (2, 1)
    broken = inventory(tmp_path, {"a": fast, "b": {**fast, "vllm_tensor_parallel_size": 3}})
    caplog.clear()
    main(["status", "-i", str(broken), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["hosts"]) == ["a", "b"] and not doc.get("balancers"), doc
    assert any("balancers not read" in r.getMessage() and "b" in r.getMessage() for r in caplog.records)
