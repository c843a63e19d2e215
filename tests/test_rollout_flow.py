"""Rollouts against scripted hosts: instance order, drain, GPU release, hooks, automatic rollback, batches,
pre-flight and resume. The lab tests run the same flows against real systemd and the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.errors import DeployError, ExitCode
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.restart import Restarter, RestartOptions
from ernie_deploy.orchestration.results import HostResult, Status, exit_code
from ernie_deploy.orchestration.rollout import RolloutOptions
from ernie_deploy.planning.plan import PlanContext

TWO = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}
FAST = {"health_timeout": 5.0, "stable": 0.0, "poll": 0.01}


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "rollouts"
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(path))
    return path


def hosts_of(tmp_path: Path, hosts: dict[str, dict]) -> list:  # type: ignore[type-arg]
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1"}, "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return list(load_inventory(path).select(None))


def cycle(**kw: object) -> CycleOptions:
    return CycleOptions(**{"idle_timeout": 2.0, "gpu_timeout": 0.3, "poll": 0.01, **kw})  # type: ignore[arg-type]


def deploy(fakes: dict[str, FakeHost], hosts: list, *, rollout: RolloutOptions | None = None,  # type: ignore[type-arg]
           **kw: object) -> list[HostResult]:
    opts = Options(**FAST, cycle=cycle(**kw), rollout=rollout or RolloutOptions())  # type: ignore[arg-type]
    return Runner(PlanContext.load(), connector(fakes), opts).run(hosts)


def restart(fakes: dict[str, FakeHost], hosts: list, *, rollout: RolloutOptions | None = None,  # type: ignore[type-arg]
            mode: str = "restart", to: str | None = None, instance: str | None = None,
            **kw: object) -> tuple[Restarter, list[HostResult]]:
    opts = RestartOptions(mode=mode, to=to, instance=instance,
                          cycle=cycle(command=mode, health_timeout=5.0, stable=0.0, **kw),
                          rollout=rollout or RolloutOptions(serial=[1], preflight=True, resume_key="k"))
    runner = Restarter(PlanContext.load(), connector(fakes), opts)
    return runner, runner.run(hosts)


def test_two_replicas_restart_one_at_a_time(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": TWO}))
    fakes["a"].log.clear()
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {**TWO, "vllm_max_model_len": 2048}}))
    assert r.status is Status.CHANGED, r.message
    # Never both down: the second stops only after the first is back.
    assert fakes["a"].log == ["stop ernie-vllm-0.service", "start ernie-vllm-0.service",
                              "stop ernie-vllm-1.service", "start ernie-vllm-1.service"]
    assert "one at a time" in r.message
    assert set(r.timings) == {"ernie-vllm-0.service", "ernie-vllm-1.service"}
    assert {"drain", "stop", "gpu_release", "ready"} <= set(r.timings["ernie-vllm-0.service"])


def test_parallel_instances_stop_all_then_start_all(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": TWO}))
    fakes["a"].log.clear()
    deploy(fakes, hosts_of(tmp_path, {"a": {**TWO, "vllm_max_model_len": 2048}}), parallel_instances=True)
    assert fakes["a"].log == ["stop ernie-vllm-0.service", "stop ernie-vllm-1.service",
                              "start ernie-vllm-0.service", "start ernie-vllm-1.service"]


def test_moving_gpus_goes_as_a_whole_and_check_mode_says_so(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))  # one TP-2 instance on GPUs 0,1
    fakes["a"].log.clear()
    (checked,) = Runner(PlanContext.load(), connector(fakes), Options(check=True, **FAST)).run(  # type: ignore[arg-type]
        hosts_of(tmp_path, {"a": TWO}))
    assert "as a whole" in checked.message and "ernie-vllm-1.service needs GPU(s) 1" in checked.message
    assert fakes["a"].log == []
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": TWO}))
    assert r.status is Status.CHANGED, r.message
    assert fakes["a"].log[0] == "stop ernie-vllm-0.service" and fakes["a"].log[1:] == [
        "start ernie-vllm-0.service", "start ernie-vllm-1.service"]


def test_failed_new_release_is_rolled_back_and_reverified(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    before = dict(fakes["a"].files)
    fakes["a"].fail_start = "--max-model-len 2048"
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    assert r.status is Status.FAILED and "CUDA out of memory" in r.message, r.message
    assert exit_code([r]) == ExitCode.FAILED
    assert fakes["a"].files == before  # byte for byte
    assert "ernie-vllm-0.service" in fakes["a"].active  # running again, on the old release
    (line,) = r.change.rollbacks
    assert "rolled back to release" in line and "ready and verified" in line
    assert fakes["a"].log[-3:] == ["start ernie-vllm-0.service", "undo ernie-vllm-0.service",
                                   "start ernie-vllm-0.service"]


def test_no_rollback_keeps_the_failed_state(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].fail_start = "--max-model-len 2048"
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}), rollback=False)
    assert r.status is Status.FAILED and "--no-rollback" in r.change.rollbacks[0]
    assert "2048" in fakes["a"].files["/etc/systemd/system/ernie-vllm-0.service"]


def test_failed_first_deploy_is_stopped_and_disabled(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(fail_start="vllm")}
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    assert r.status is Status.FAILED
    assert "first deploy" in r.change.rollbacks[0] and "stopped and disabled" in r.change.rollbacks[0]
    assert "ernie-vllm-0.service" not in fakes["a"].active


def test_failure_of_the_first_replica_gives_the_second_its_files_back(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": TWO}))
    before = dict(fakes["a"].files)
    fakes["a"].fail_start = "--max-model-len 2048"
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {**TWO, "vllm_max_model_len": 2048}}))
    assert r.status is Status.FAILED
    assert fakes["a"].files == before and not fakes["a"].pending
    assert "stop ernie-vllm-1.service" not in fakes["a"].log  # never touched


def test_idle_wait_polls_until_no_request_is_left(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].in_flight = [3, 1, 0]
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    assert r.status is Status.CHANGED
    assert r.command_log.count("read metrics") == 3
    (drain,) = [s for s in r.steps if s.name == "drain ernie-vllm-0"]
    assert drain.status == "ok" and "0 requests" in drain.evidence[0]


def test_idle_timeout_is_a_warning_and_the_stop_goes_on(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].in_flight = [5] * 10_000
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}), idle_timeout=0.1)
    assert r.status is Status.CHANGED
    (warn,) = [c for c in r.checks if c.name == "drain"]
    assert warn.status == "warn" and "5 request(s) still in flight" in warn.summary


def test_orphan_on_the_gpu_is_refused_before_anything_stops_naming_pid_gpu_and_fix(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}, "b": {}}))
    fakes["a"].orphan = 4242
    for fake in fakes.values():
        fake.log.clear()
    _, (r, other) = restart(fakes, hosts_of(tmp_path, {"a": {}, "b": {}}))
    assert r.status is Status.FAILED and "refused before stopping anything" in r.message, r.message
    assert "PID 4242 (VLLM::EngineCore) holds 20000 MiB on its GPU 0" in r.message
    assert r.hint and "kill 4242" in r.hint and "keep serving" in r.hint
    assert fakes["a"].log == [] and "ernie-vllm-0.service" in fakes["a"].active  # never stopped: still serving
    # The rollout does not start on top of it (nothing was stopped anywhere).
    assert other.status is Status.SKIPPED and fakes["b"].log == []
    # A plain deploy of a change refuses that host the same way, and still changes the other.
    longer = {"vllm_max_model_len": 2048}
    (r, other) = deploy(fakes, hosts_of(tmp_path, {"a": longer, "b": longer}))
    assert r.status is Status.FAILED and "PID 4242" in r.message and fakes["a"].log == []
    assert other.status is Status.CHANGED, other.message


def test_a_first_start_takes_the_gates_first_gpu_reading_from_the_stage(tmp_path: Path) -> None:
    """Nothing runs on a fresh host to stop: the stage's command reads the first instance's GPUs, and the gate
    asks no reading of its own for it; the second instance starts after the first took its GPU memory, so it
    is read on its own."""
    fakes = {"a": FakeHost()}
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": TWO}))
    assert r.status is Status.CHANGED, r.message
    log = r.command_log
    assert log.index("stage files") + 1 == log.index("activate units")
    assert log.count("read GPU release") == 1
    assert log.index("read GPU release") > log.index("watch instance ernie-vllm-0.service")


def test_an_orphan_on_a_fresh_hosts_gpu_fails_its_first_start_from_the_stages_reading(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    fakes["a"].orphan = 4242
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    assert r.status is Status.FAILED, r.message
    assert "not free for the first start" in r.message and "PID 4242" in r.message
    assert r.hint and "kill 4242" in r.hint and "it was not started" in r.hint
    assert not fakes["a"].starts and not fakes["a"].active
    assert "activate units" not in r.command_log


def test_hooks_get_their_context_and_a_failing_pre_drain_stops_before_any_stop(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": {}, "b": {}})
    deploy(fakes, hosts)
    seen = tmp_path / "seen.jsonl"
    hook = f"python3 -c 'import json,os; print(json.dumps({{k: v for k, v in os.environ.items() " \
           f"if k.startswith(\"ERNIE_\")}}))' >> {seen}"
    _, results = restart(fakes, hosts, pre_drain=hook, post_ready=hook)
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED], [r.message for r in results]
    lines = [json.loads(x) for x in seen.read_text().splitlines()]
    assert [(x["ERNIE_HOOK"], x["ERNIE_HOST"], x["ERNIE_BATCH"]) for x in lines] == [
        ("pre-drain", "a", "1"), ("post-ready", "a", "1"), ("pre-drain", "b", "2"), ("post-ready", "b", "2")]
    assert lines[0]["ERNIE_UNIT"] == "ernie-vllm-0.service" and lines[0]["ERNIE_COMMAND"] == "restart"
    assert lines[0]["ERNIE_PORT"] == "8000" and lines[0]["ERNIE_ADDRESS"] == "127.0.0.1"
    for fake in fakes.values():
        fake.log.clear()
    _, results = restart(fakes, hosts, pre_drain="echo no >&2; exit 1")
    assert results[0].status is Status.FAILED and "pre-drain hook exited 1" in results[0].message
    assert results[0].evidence[0] == "no"
    assert results[1].status is Status.SKIPPED and "stopped after the first batch" in results[1].message
    assert fakes["a"].log == [] and fakes["b"].log == []


def test_failed_batch_stops_the_rollout_and_later_hosts_are_untouched(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "abcd"}
    hosts = hosts_of(tmp_path, {h: {} for h in "abcd"})
    deploy(fakes, hosts)
    fakes["b"].fail_start = "vllm"  # every start of b fails from now on
    for fake in fakes.values():
        fake.log.clear()
    runner, results = restart(fakes, hosts)
    assert [r.status for r in results] == [Status.CHANGED, Status.FAILED, Status.SKIPPED, Status.SKIPPED]
    assert runner.report.stopped == "the rollout stopped after batch 2: 1 of 1 host(s) failed"
    assert fakes["c"].log == [] and fakes["d"].log == []
    assert exit_code(results) == ExitCode.FAILED
    assert [m.kind for m in runner.report.timeline.marks].count("stop") == 1


def test_max_fail_percentage_lets_a_partly_failed_batch_continue(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "abcde"}
    hosts = hosts_of(tmp_path, {h: {} for h in "abcde"})
    deploy(fakes, hosts)
    fakes["c"].fail_start = "vllm"
    rollout = RolloutOptions(serial=[1, 2], preflight=True, max_fail_percentage=50, resume_key="k")
    runner, results = restart(fakes, hosts, rollout=rollout)
    # Batches a | b c | d e: 1 of 2 failed is 50 %, not more: the rollout goes on.
    assert runner.report.batches == [["a"], ["b", "c"], ["d", "e"]]
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED, Status.FAILED, Status.CHANGED,
                                           Status.CHANGED]


def test_preflight_refuses_when_an_instance_is_down_unless_forced(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": {}, "b": {}})
    deploy(fakes, hosts)
    fakes["b"].active.clear()  # b's instance died
    for fake in fakes.values():
        fake.log.clear()
    runner, results = restart(fakes, hosts)
    assert results[1].status is Status.FAILED and "already down: b ernie-vllm-0.service" in results[1].message
    assert results[0].status is Status.SKIPPED and fakes["a"].log == [] and fakes["b"].log == []
    assert runner.report.refused == ["b ernie-vllm-0.service: not running (inactive/dead)"]
    rollout = RolloutOptions(serial=[1], preflight=True, force=True, resume_key="k")
    _, results = restart(fakes, hosts, rollout=rollout)
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED]


def test_resume_continues_after_the_done_batches(tmp_path: Path, state_dir: Path) -> None:
    fakes = {h: FakeHost() for h in "abc"}
    hosts = hosts_of(tmp_path, {h: {} for h in "abc"})
    deploy(fakes, hosts)
    fakes["b"].fail_start = "vllm"
    restart(fakes, hosts)
    saved = json.loads((state_dir / "k.json").read_text())
    assert saved["batches"] == [["a"], ["b"], ["c"]] and saved["done"] == [0]
    fakes["b"].fail_start = None
    fakes["b"].active["ernie-vllm-0.service"] = 99  # repaired by hand
    starts = {h: dict(f.starts) for h, f in fakes.items()}
    resumed = RolloutOptions(serial=[1], preflight=True, resume=True, resume_key="k", command="restart")
    _, results = restart(fakes, hosts, rollout=resumed)
    assert [r.status for r in results] == [Status.OK, Status.CHANGED, Status.CHANGED], [r.message for r in results]
    assert "done in batch 1" in results[0].message
    assert fakes["a"].starts == starts["a"]  # batch 1 was not restarted again
    assert not (state_dir / "k.json").exists()  # completed: nothing left to resume
    with pytest.raises(DeployError, match="no stopped restart rollout"):
        restart(fakes, hosts, rollout=resumed)


def test_rollback_restores_the_previous_release_byte_for_byte(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    old = dict(fakes["a"].files)
    deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    assert fakes["a"].files != old
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}), mode="rollback")
    assert r.status is Status.CHANGED and "rolled back to release" in r.message, r.message
    assert fakes["a"].files == old
    # Verified against what the release runs (4096), not today's plan (2048): every check passed.
    assert not [c for c in r.checks if c.status == "fail"]


def test_rollback_to_an_unknown_release_names_the_kept_ones(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {}}), mode="rollback", to="20990101T000000Z-deadbeef")
    assert r.status is Status.FAILED and "not kept" in r.message
    assert r.hint and fakes["a"].releases[0]["id"] in r.hint


def test_restart_refuses_a_host_whose_files_differ_from_the_plan(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].log.clear()
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    assert r.status is Status.FAILED and "differ from the plan" in r.message and fakes["a"].log == []


def test_unknown_instance_is_a_clear_error(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {}}), instance="7")
    assert r.status is Status.FAILED and "no instance '7'" in r.message and r.hint and "0 (ernie-vllm-0)" in r.hint


def test_releases_lists_what_is_kept_and_marks_the_current_one(tmp_path: Path) -> None:
    from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
    from ernie_deploy.orchestration.hosts import list_releases

    fakes = {"a": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": {}})
    deploy(fakes, hosts)
    deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    ((result, kept, now),) = list_releases(Fleet(connector(fakes), FleetOptions()), PlanContext.load(), hosts)
    assert [r.id for r in kept] == [str(r["id"]) for r in fakes["a"].releases] and len(kept) == 2
    assert now == kept[-1].id and kept[-1].changed and not result.finished


def test_timeline_has_a_row_per_instance_with_its_phases(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": TWO, "b": {}})
    deploy(fakes, hosts)
    runner, _ = restart(fakes, hosts)
    timeline = runner.report.timeline
    assert timeline.rows == ["a ernie-vllm-0.service", "a ernie-vllm-1.service", "b ernie-vllm-0.service"]
    phases = [s.phase for s in timeline.spans if s.row == "a ernie-vllm-0.service"]
    assert phases == ["drain", "stop", "gpu-release", "load", "ready"]
    assert [m.label for m in timeline.marks if m.kind == "batch"] == ["batch 1", "batch 2"]


@pytest.mark.parametrize(("args", "words"), [
    (["--serial", "33.3%"], "33.3%"),
    (["--serial", "-1"], "-1"),
    (["--max-fail-percentage", "150"], "150"),
    (["--canary", "-2"], "--canary"),
    (["--timeline", "out.png"], ".svg or .html"),
    (["--check", "--resume"], "--resume cannot be combined with --check"),
])
def test_bad_rollout_options_exit_5_before_touching_a_host(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            args: list[str], words: str) -> None:
    from ernie_deploy.cli.main import main

    hosts_of(tmp_path, {"a": {"ansible_port": 1}})  # never contacted: the options fail first
    rc = main(["restart", "-i", str(tmp_path / "inv.yml"), *args])
    err = capsys.readouterr().err
    assert rc == ExitCode.INPUT and words in err, err


def test_units_of_one_host_on_different_releases_each_go_back_to_their_own(tmp_path: Path) -> None:
    """After instance 1 alone was rolled back, no release matches the host as a whole; a later failure must
    still restore each unit to what it ran, never disable a unit that was serving."""
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": TWO}))  # release A
    a_files = dict(fakes["a"].files)
    fakes["a"].fail_start = "--port 8001 && 2048"  # B fails on instance 1 only
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {**TWO, "vllm_max_model_len": 2048}}))
    assert r.status is Status.FAILED and "rolled back to release" in r.change.rollbacks[0]
    b_unit0 = fakes["a"].files["/etc/systemd/system/ernie-vllm-0.service"]
    assert "2048" in b_unit0 and fakes["a"].files["/etc/systemd/system/ernie-vllm-1.service"] == \
        a_files["/etc/systemd/system/ernie-vllm-1.service"]
    fakes["a"].fail_start = "--port 8000 && 3072"  # C fails on instance 0, before instance 1 is reached
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {**TWO, "vllm_max_model_len": 3072}}))
    assert r.status is Status.FAILED
    rollbacks = r.change.rollbacks
    assert "ready and verified" in rollbacks[0] and not any("disabled" in x for x in rollbacks), rollbacks
    assert fakes["a"].files["/etc/systemd/system/ernie-vllm-0.service"] == b_unit0  # back to B
    assert fakes["a"].files["/etc/systemd/system/ernie-vllm-1.service"] == \
        a_files["/etc/systemd/system/ernie-vllm-1.service"]  # never reached: A's files again, not C's
    assert not fakes["a"].pending and set(fakes["a"].active) == {"ernie-vllm-0.service", "ernie-vllm-1.service"}
    # "The one before" is not defined for such a host: rollback wants --to.
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": TWO}), mode="rollback")
    assert r.status is Status.FAILED and "--to" in (r.hint or "")


def test_stage_never_prunes_a_release_a_unit_runs() -> None:
    from ernie_deploy.remote import converge

    cmd = converge.stage_command([], converge.Changes(), {}, {"id": "20261203T000000.000Z-new"}, 1,
                                 protect=("20261101T000000.000Z-old",))
    prune = next(line for line in cmd.script.splitlines() if "head -n -1" in line)
    assert "-e 20261101T000000.000Z-old" in prune and "-e 20261203T000000.000Z-new" in prune


def test_any_errors_fatal_stops_the_rollout_and_nothing_counts_as_done(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "abc"}
    hosts = hosts_of(tmp_path, {h: {} for h in "abc"})
    deploy(fakes, hosts)
    fakes["a"].fail_start = "2048"
    opts = Options(**FAST, any_errors_fatal=True, cycle=cycle(),  # type: ignore[arg-type]
                   rollout=RolloutOptions(serial=[1], preflight=True, resume_key="fatal"))
    runner = Runner(PlanContext.load(), connector(fakes), opts)
    results = runner.run(hosts_of(tmp_path, {h: {"vllm_max_model_len": 2048} for h in "abc"}))
    assert [r.status for r in results] == [Status.FAILED, Status.SKIPPED, Status.SKIPPED]
    assert runner.report.stopped and runner.report.done == []


def test_a_partly_failed_batch_is_not_done_so_resume_retries_it(tmp_path: Path, state_dir: Path) -> None:
    fakes = {h: FakeHost() for h in "abcd"}
    hosts = hosts_of(tmp_path, {h: {} for h in "abcd"})
    deploy(fakes, hosts)
    fakes["c"].fail_start = "vllm"
    rollout = RolloutOptions(serial=[2], preflight=True, max_fail_percentage=60, resume_key="k", command="restart")
    runner, results = restart(fakes, hosts, rollout=rollout)
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED, Status.FAILED, Status.CHANGED]
    # Batch 1 (a, b) done; batch 2 (c, d): 1 of 2 failed, not over 60 %: not stopped, but not done either.
    assert not runner.report.stopped and runner.report.done == [0]
    assert json.loads((state_dir / "k.json").read_text())["done"] == [0]


def test_ctrl_c_during_the_gpu_wait_still_brings_the_instance_back(tmp_path: Path) -> None:
    """The instance is stopped when Ctrl-C comes: the gate keeps waiting for its GPUs and it is started again
    (not verified), instead of being left down."""
    import _thread
    import time as clock

    from ernie_deploy.remote.rolling import GpuRelease

    class SlowRelease(FakeHost):
        readings = -1  # not armed during the first deploy

        def gpu_release(self, release: GpuRelease) -> str:
            if self.readings < 0 or set(release.units) <= set(self.active):  # the pre-flight's read: serving
                return super().gpu_release(release)
            self.readings += 1
            if self.readings == 1:
                _thread.interrupt_main()  # what Ctrl-C does
                clock.sleep(0.2)
            self.orphan = 4242 if self.readings < 4 else None  # the driver lets go after a while
            return super().gpu_release(release)

    fakes: dict[str, FakeHost] = {"a": SlowRelease()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].log.clear()
    fakes["a"].readings = 0  # type: ignore[attr-defined]
    opts = RestartOptions(cycle=cycle(command="restart", health_timeout=5.0, stable=0.0, gpu_timeout=5.0),
                          rollout=RolloutOptions(serial=[1], preflight=True, resume_key="k"))
    runner = Restarter(PlanContext.load(), connector(fakes), opts)
    (r,) = runner.run(hosts_of(tmp_path, {"a": {}}))
    assert runner.stopped_by is not None
    assert fakes["a"].log == ["stop ernie-vllm-0.service", "start ernie-vllm-0.service"]
    assert r.status is Status.FAILED and "not verified" in r.message and "interrupted" in r.message


def test_a_release_that_failed_is_marked_and_a_rollback_onto_it_wants_force(tmp_path: Path) -> None:
    from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
    from ernie_deploy.orchestration.hosts import list_releases

    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].fail_start = "--max-model-len 2048"
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    assert r.status is Status.FAILED and r.change is not None and r.change.release
    bad = r.change.release
    ((_, kept, now),) = list_releases(Fleet(connector(fakes), FleetOptions()), PlanContext.load(),
                                      hosts_of(tmp_path, {"a": {}}))
    marked = {x.id: x.failed for x in kept}
    assert marked[now or ""] is None  # what runs again did not fail
    failed = marked[bad]
    assert failed is not None and failed.units == ("ernie-vllm-0.service",) and "CUDA out of memory" in failed.reason
    fakes["a"].fail_start = None
    fakes["a"].log.clear()
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {}}), mode="rollback", to=bad)
    assert r.status is Status.FAILED and bad in r.message and "CUDA out of memory" in r.message, r.message
    assert failed.time in r.message and r.hint and "--force" in r.hint and fakes["a"].log == []
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {}}), mode="rollback", to=bad,
                      rollout=RolloutOptions(serial=[1], preflight=True, resume_key="k", force=True))
    assert r.status is Status.CHANGED and "rolled back to release" in r.message, r.message
    assert any("--force" in e and bad in e for e in r.evidence)


def test_rollback_check_shows_each_files_diff_and_changes_nothing(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    now = dict(fakes["a"].files)
    fakes["a"].log.clear()
    opts = RestartOptions(mode="rollback", check=True, cycle=cycle(command="rollback"),
                          rollout=RolloutOptions(serial=[1], preflight=True))
    (r,) = Restarter(PlanContext.load(), connector(fakes), opts).run(hosts_of(tmp_path, {"a": {}}))
    assert r.status is Status.CHANGED and "would restore release" in r.message, r.message
    assert r.change is not None and len(r.change.diffs) == 1, r.change.diffs
    (diff,) = r.change.diffs
    assert "-" in diff and "--max-model-len 2048" in diff and "4096" in diff and "(release " in diff
    assert fakes["a"].files == now and fakes["a"].log == []


def test_the_failed_mark_is_written_beside_the_release_and_listed(tmp_path: Path) -> None:
    """The shell the host runs: Undo writes failed.json into the failed release's directory, ListReleases
    prints it after that release's record (run with the state paths moved into tmp_path)."""
    import subprocess

    from ernie_deploy.remote import releases

    state, log = tmp_path / "state", tmp_path / "log/audit.log"
    rid = "20260101T000000.000Z-abcdef12"
    (state / "releases" / rid).mkdir(parents=True)
    (state / "releases" / rid / "release.json").write_text(json.dumps({"id": rid, "files": {}, "changed": []}))
    (state / "releases/20250101T000000.000Z-00000000").mkdir()
    (state / "releases/20250101T000000.000Z-00000000/release.json").write_text('{"id": "20250101T000000.000Z-0000')
    (state / "releases/20250101T000000.000Z-00000000/failed.json").write_text('{"time": "x", "reason": "y"}')

    def run(script: str) -> str:
        script = script.replace("/var/lib/ernie-deploy", str(state)).replace("/var/log/ernie-deploy/audit.log",
                                                                                str(log))
        shims = tmp_path / "bin"
        shims.mkdir(exist_ok=True)
        (shims / "systemctl").write_text("#!/bin/sh\n")
        (shims / "systemctl").chmod(0o755)
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                              env={"PATH": f"{shims}:/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        return done.stdout

    failed = releases.Failed("2026-01-01T00:05:00Z", "ernie-vllm-0.service: CUDA out of memory 'x' $HOME",
                             ("ernie-vllm-0.service",))
    run(releases.Undo({}, (), (), {"action": "rollback"}, (rid, failed)).render())
    run(releases.Undo({}, (), (), {"action": "rollback"}, ("20990101T000000.000Z-gone0000", failed)).render())
    kept = releases.parse_list(run(releases.ListReleases().render()))
    assert [(r.id, r.failed) for r in kept] == [(rid, failed)]  # the unreadable record's mark attaches to nothing
    assert kept.skipped == ("20250101T000000.000Z-00000000",)


def test_releases_prints_what_each_changed_and_which_failed(capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.output.remote import show_releases
    from ernie_deploy.remote.releases import Failed, Release

    unit = "/etc/systemd/system/ernie-vllm-0.service"
    good = Release("20260101T000000.000Z-aaaaaaaa", "2026-01-01T00:00:00Z", "ops", "ernie-deploy deploy", {}, (unit,))
    bad = Release("20260102T000000.000Z-bbbbbbbb", "2026-01-02T00:00:00Z", "ops", "ernie-deploy deploy", {}, (unit,),
                  Failed("2026-01-02T00:01:00Z", "ernie-vllm-0.service: CUDA out of memory", ("ernie-vllm-0.service",)))
    listed = [(HostResult("a"), [good, bad], good.id)]
    show_releases(listed, json=False)
    out = capsys.readouterr().out
    assert f"{good.id}  2026-01-01T00:00:00Z  ops  ernie-deploy deploy  changed: ernie-vllm-0.service  (current)" in out
    assert ("FAILED: failed at 2026-01-02T00:01:00Z on ernie-vllm-0.service and was rolled back: ernie-vllm-0.service: "
            f"CUDA out of memory (rollback --to {bad.id} asks for --force)") in " ".join(out.split())
    show_releases(listed, json=True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ernie-deploy/releases/v2"
    first, second = doc["hosts"]["a"]["releases"]
    assert first["failed"] is None and first["changed"] == [unit]
    assert second["failed"] == {"time": "2026-01-02T00:01:00Z", "reason": "ernie-vllm-0.service: CUDA out of memory",
                                "units": ["ernie-vllm-0.service"]}


def cli_rollout(tmp_path: Path, command: str, *args: str) -> RolloutOptions:
    """The rollout options the command line builds (what a plain `deploy` / `restart` gets by default)."""
    from ernie_deploy.cli import rollout as cli_options
    from ernie_deploy.cli.main import build_parser

    parsed = build_parser().parse_args([command, "-i", str(tmp_path / "inv.yml"), *args])
    return cli_options.rollout_options(parsed, command, preflight=parsed.serial is not None)


def test_plain_deploy_of_a_change_rolls_one_host_at_a_time_and_check_mode_says_so(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "abc"}
    hosts = hosts_of(tmp_path, {h: {} for h in "abc"})
    first = Runner(PlanContext.load(), connector(fakes), Options(**FAST, cycle=cycle(),  # type: ignore[arg-type]
                                                                 rollout=cli_rollout(tmp_path, "deploy")))
    first.run(hosts)
    assert first.report.batches == [["a", "b", "c"]]  # nothing ran yet: nothing to lose, all at once
    changed = hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}, "b": {"vllm_max_model_len": 2048}, "c": {}})
    checked = Runner(PlanContext.load(), connector(fakes), Options(  # type: ignore[arg-type]
        **FAST, check=True, cycle=cycle(), rollout=cli_rollout(tmp_path, "deploy", "--check")))
    checked.run(changed)
    # c has nothing to change (nothing it serves is stopped): it goes with the first batch.
    assert checked.report.batches == [["c"], ["a"], ["b"]]
    assert "one host at a time" in checked.report.how and "--serial all" in checked.report.how
    runner = Runner(PlanContext.load(), connector(fakes), Options(**FAST, cycle=cycle(),  # type: ignore[arg-type]
                                                                  rollout=cli_rollout(tmp_path, "deploy")))
    results = runner.run(changed)
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED, Status.OK], [r.message for r in results]
    assert runner.report.batches == [["c"], ["a"], ["b"]] and runner.report.done == [0, 1, 2]
    assert [r.change.batch for r in results] == [2, 3, 1]


def test_every_host_at_once_must_be_asked_for_by_name(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "ab"}
    deploy(fakes, hosts_of(tmp_path, {h: {} for h in "ab"}))
    changed = hosts_of(tmp_path, {h: {"vllm_max_model_len": 2048} for h in "ab"})
    runner = Runner(PlanContext.load(), connector(fakes), Options(  # type: ignore[arg-type]
        **FAST, cycle=cycle(), rollout=cli_rollout(tmp_path, "deploy", "--serial", "all")))
    runner.run(changed)
    assert runner.report.batches == [["a", "b"]] and "every host at once" in runner.report.how
    for command in ("deploy", "restart"):
        with pytest.raises(DeployError) as err:
            cli_rollout(tmp_path, command, "--serial", "0")
        assert err.value.hint and "--serial all" in err.value.hint
    restarter = Restarter(PlanContext.load(), connector(fakes), RestartOptions(
        cycle=cycle(command="restart", health_timeout=5.0, stable=0.0), rollout=cli_rollout(tmp_path, "restart")))
    restarter.run(changed)
    assert restarter.report.batches == [["a"], ["b"]]


def test_the_inventory_sets_the_serial_once_for_the_rollout(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "abc"}
    deploy(fakes, hosts_of(tmp_path, {h: {} for h in "abc"}))
    hosts = hosts_of(tmp_path, {h: {"vllm_max_model_len": 2048, "vllm_serial": 2} for h in "abc"})
    runner = Runner(PlanContext.load(), connector(fakes), Options(**FAST, cycle=cycle(),  # type: ignore[arg-type]
                                                                  rollout=cli_rollout(tmp_path, "deploy")))
    runner.run(hosts)
    assert runner.report.batches == [["a", "b"], ["c"]]
    hosts = hosts_of(tmp_path, {"a": {"vllm_serial": 2}, "b": {"vllm_serial": 1}})
    with pytest.raises(DeployError) as err:
        Runner(PlanContext.load(), connector(fakes), Options(rollout=cli_rollout(tmp_path, "deploy"))).run(hosts)
    assert "vllm_serial differs" in err.value.message and "a: 2" in err.value.message and err.value.hint


HOOKS = "printf '%s %s %s\\n' \"$ERNIE_HOOK\" \"$ERNIE_HOST\" \"$ERNIE_UNIT\" >> {log}"


def test_an_automatic_rollback_puts_the_instance_back_into_the_load_balancer(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].fail_start = "--max-model-len 2048"
    log = tmp_path / "hooks.log"
    hook = HOOKS.format(log=log)
    (r,) = deploy(fakes, hosts_of(tmp_path, {"a": {"vllm_max_model_len": 2048}}), pre_drain=hook, post_ready=hook,
                  rollout=RolloutOptions(resume_key="k"))
    assert r.status is Status.FAILED
    assert log.read_text().splitlines() == ["pre-drain a ernie-vllm-0.service", "post-ready a ernie-vllm-0.service"]
    (line,) = r.change.rollbacks
    assert "ready and verified; back in the load balancer (post-ready)" in line, line
    assert not [c for c in r.checks if c.name == "rotation"] and not list((tmp_path / "rollouts").glob("*"))


def test_an_instance_left_out_of_rotation_is_named_kept_and_put_back_by_resume(tmp_path: Path,
                                                                               state_dir: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": {}, "b": {}})
    deploy(fakes, hosts)
    log = tmp_path / "hooks.log"
    # The record is on disk before the pre-drain hook starts: a controller killed with -9 leaves it behind.
    pre = HOOKS.format(log=log) + f"; cat {state_dir}/*.json > {tmp_path}/at-pre-drain.json"
    runner, results = restart(fakes, hosts, pre_drain=pre, post_ready=f"{HOOKS.format(log=log)}; exit 3")
    assert json.loads((tmp_path / "at-pre-drain.json").read_text())["out"] == {"a": ["ernie-vllm-0.service"]}
    a, b = results
    assert a.status is Status.FAILED and "post-ready hook exited 3" in a.message
    assert b.status is Status.SKIPPED  # the rollout stopped after the canary
    (named,) = [c for c in a.checks if c.name == "rotation"]
    assert named.status == "fail" and "ernie-vllm-0.service is out of the load balancer" in named.summary
    assert named.fix and "--resume" in named.fix
    assert runner.report.rotation.snapshot() == {"a": ["ernie-vllm-0.service"]}
    log.write_text("")
    runner, results = restart(fakes, hosts, pre_drain=HOOKS.format(log=log), post_ready=HOOKS.format(log=log),
                              rollout=RolloutOptions(serial=[1], preflight=True, resume_key="k", resume=True))
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED], [r.message for r in results]
    assert log.read_text().splitlines() == [
        "post-ready a ernie-vllm-0.service",  # a serves: put back first, before anything else happens
        "pre-drain a ernie-vllm-0.service", "post-ready a ernie-vllm-0.service",  # its batch, retried
        "pre-drain b ernie-vllm-0.service", "post-ready b ernie-vllm-0.service"]
    assert runner.report.rotation.snapshot() == {} and not list(state_dir.glob("*.json"))


def test_gpu_gate_failure_names_the_instance_down_and_out_of_rotation(tmp_path: Path) -> None:
    from ernie_deploy.remote.rolling import Stop

    class OrphanAfterStop(FakeHost):
        def stop(self, stop: Stop) -> str:
            self.orphan = 4242  # a worker that outlives the stop
            return super().stop(stop)

    fakes: dict[str, FakeHost] = {"a": OrphanAfterStop()}
    deploy(fakes, hosts_of(tmp_path, {"a": {}}))
    fakes["a"].orphan = None
    log = tmp_path / "hooks.log"
    _, (r,) = restart(fakes, hosts_of(tmp_path, {"a": {}}), pre_drain=HOOKS.format(log=log),
                      post_ready=HOOKS.format(log=log))
    assert r.status is Status.FAILED and "not released" in r.message and "stays stopped" in (r.hint or "")
    assert "ernie-vllm-0.service" not in fakes["a"].active
    (named,) = [c for c in r.checks if c.name == "rotation"]
    assert "out of the load balancer" in named.summary


def test_resume_takes_over_its_own_stale_lock_and_says_how_to_break_others(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess

    from ernie_deploy.orchestration import resume
    from ernie_deploy.remote.lock import LockInfo

    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": {}, "b": {}})
    deploy(fakes, hosts)
    # The stopped rollout's controller was killed with -9: its state and locks stay, its process is gone.
    resume.save(resume.RolloutState("k", "restart", [["a"], ["b"]]))
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = LockInfo.mine("ernie-deploy restart")
    stale = LockInfo("t0", me.user, socket.gethostname(), dead.pid, "ernie-deploy restart", me.since)
    for fake in fakes.values():
        fake.lock_info = stale.to_json()
    resume_opts = RolloutOptions(serial=[1], preflight=True, resume_key="k", resume=True)
    _, results = restart(fakes, hosts, rollout=resume_opts)
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED], [r.message for r in results]
    assert all(f.lock_info is None for f in fakes.values())
    # Another controller's lock is not taken over; the hint breaks every host's lock in one command.
    resume.save(resume.RolloutState("k", "restart", [["a"], ["b"]]))
    fakes["a"].lock_info = LockInfo("t1", me.user, "elsewhere", os.getpid(), "ernie-deploy restart",
                                    me.since).to_json()
    _, (r, _) = restart(fakes, hosts, rollout=resume_opts)
    assert r.status is Status.LOCKED and r.hint and "ernie-deploy lock -i INV --break" in r.hint, r.hint
    assert fakes["a"].lock_info is not None


def test_resume_after_kill_9_mid_restart_starts_the_stopped_instance_and_puts_it_back(tmp_path: Path) -> None:
    from ernie_deploy.orchestration import resume

    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = hosts_of(tmp_path, {"a": {}, "b": {}})
    deploy(fakes, hosts)
    # What a controller killed with -9 between a's stop and its start leaves: a down, out of rotation.
    resume.save(resume.RolloutState("k", "restart", [["a"], ["b"]], out={"a": ["ernie-vllm-0.service"]}))
    fakes["a"].active.pop("ernie-vllm-0.service")
    log = tmp_path / "hooks.log"
    runner, results = restart(fakes, hosts, pre_drain=HOOKS.format(log=log), post_ready=HOOKS.format(log=log),
                              rollout=RolloutOptions(serial=[1], preflight=True, resume_key="k", resume=True))
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED], [r.message for r in results]
    assert any("down when resumed" in e for e in results[0].evidence)
    assert log.read_text().splitlines() == ["post-ready a ernie-vllm-0.service", "pre-drain b ernie-vllm-0.service",
                                            "post-ready b ernie-vllm-0.service"]
    assert runner.report.rotation.snapshot() == {} and resume.load("k") is None
