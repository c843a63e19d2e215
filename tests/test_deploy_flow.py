"""Deploy orchestration against scripted hosts: results, recap, exit codes, locks, round trips.

The scripted hosts apply changes but start no vLLM, so the readiness watch is exercised in the lab tests.
"""

from __future__ import annotations

import threading
from pathlib import Path

import yaml
from fakehost import FakeHost, connector

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.results import (
    EXIT_FAILED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    Status,
    exit_code,
    recap_counts,
)
from ernie_deploy.planning.plan import PlanContext


def inventory(tmp_path: Path, hosts: dict[str, dict]) -> list:  # type: ignore[type-arg]
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1"},
                    "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return list(load_inventory(path).select(None))


def runner(fakes: dict[str, FakeHost], **opts: object) -> Runner:
    return Runner(PlanContext.load(), connector(fakes), Options(health_timeout=5, **opts))  # type: ignore[arg-type]


def test_first_deploy_changes_then_second_is_a_no_op(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = inventory(tmp_path, {"a": {}, "b": {}})
    first = runner(fakes).run(hosts)
    assert [r.status for r in first] == [Status.CHANGED, Status.CHANGED]
    assert sorted(fakes["a"].files) == ["/etc/ernie-deploy/ernie-vllm-0.env",
                                        "/etc/systemd/system/ernie-vllm-0.service"]
    assert first[0].started == ["ernie-vllm-0.service"] and exit_code(first) == EXIT_OK
    assert fakes["a"].lock_info is None  # released
    second = runner(fakes).run(hosts)
    assert [r.status for r in second] == [Status.OK, Status.OK]
    # One connection, lock + facts in one command, release in another: the round-trip bound.
    assert [r.commands for r in second] == [2, 2]
    assert len(fakes["a"].applied) == 1 and fakes["a"].active["ernie-vllm-0.service"] == 1


def test_changed_variable_restarts_only_that_host(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    results = runner(fakes).run(inventory(tmp_path, {"a": {"vllm_max_model_len": 2048}, "b": {}}))
    assert [r.status for r in results] == [Status.CHANGED, Status.OK]
    assert results[0].restarted == ["ernie-vllm-0.service"]
    assert results[0].changed_files == ["/etc/systemd/system/ernie-vllm-0.service"]
    assert fakes["a"].active["ernie-vllm-0.service"] == 2 and fakes["b"].active["ernie-vllm-0.service"] == 1


def test_check_mode_changes_nothing_and_takes_no_lock(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    results = runner(fakes, check=True, diff=True).run(inventory(tmp_path, {"a": {}}))
    assert results[0].status is Status.CHANGED and "check mode" in results[0].message
    assert fakes["a"].files == {} and fakes["a"].applied == [] and fakes["a"].lock_info is None
    assert results[0].command_log == ["gather facts"]
    assert any("+ExecStart=" in d for d in results[0].diffs)


def test_unreachable_host_does_not_stop_the_others(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(unreachable=True), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    assert [r.status for r in results] == [Status.UNREACHABLE, Status.CHANGED]
    assert exit_code(results) == EXIT_UNREACHABLE
    assert recap_counts(results[0]) == {"ok": 0, "changed": 0, "unreachable": 1, "failed": 0, "skipped": 0}


def test_any_errors_fatal_skips_hosts_not_yet_started(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(unreachable=True), "b": FakeHost(), "c": FakeHost()}
    results = runner(fakes, forks=1, any_errors_fatal=True).run(
        inventory(tmp_path, {"a": {}, "b": {}, "c": {}}))
    assert [r.status for r in results] == [Status.UNREACHABLE, Status.SKIPPED, Status.SKIPPED]
    assert fakes["b"].files == {} and fakes["c"].files == {}


def test_host_with_plan_errors_is_not_touched(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(gpus=4), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {
        "a": {"gpu_count": 4, "vllm_tensor_parallel_size": 3}, "b": {}}))
    assert results[0].status is Status.FAILED and results[0].findings[0].code == "tp-heads"
    assert fakes["a"].files == {} and fakes["a"].applied == [] and fakes["a"].lock_info is None
    assert results[1].status is Status.CHANGED and exit_code(results) == EXIT_FAILED


def test_bad_jump_host_fails_only_that_host_before_connecting(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {"a": {"ansible_ssh_common_args": "-J bastion:99999"},
                                                     "b": {}}))
    assert results[0].status is Status.FAILED and "ansible_ssh_common_args" in results[0].message
    assert "'bastion:99999' is not [user@]host[:port]" in results[0].message
    assert fakes["a"].files == {} and fakes["a"].lock_info is None and results[0].commands == 0
    assert results[1].status is Status.CHANGED and exit_code(results) == EXIT_FAILED

def test_inventory_gpu_count_disagreeing_with_nvidia_smi(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(gpus=2)}
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {"gpu_count": 4}}))
    assert r.status is Status.FAILED and fakes["a"].files == {}
    assert "gpu_count: inventory says 4, nvidia-smi found 2" in r.findings[0].message


def test_held_lock_fails_cleanly_with_holder(tmp_path: Path) -> None:
    other = '{"command": "ernie-deploy deploy", "controller": "ops1", "pid": 7, "since": 0, "token": "f00", ' \
            '"user": "alice"}'
    fakes = {"a": FakeHost(lock_info=other)}
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.LOCKED and exit_code([r]) == EXIT_LOCKED
    assert "alice@ops1 (pid 7)" in r.message and "--lock-wait" in (r.hint or "")
    assert fakes["a"].lock_info == other and fakes["a"].files == {}


def test_lock_wait_retries_until_released(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(lock_info='{"token": "f00", "user": "x", "controller": "y", "pid": 1, "since": 0, '
                                     '"command": "c"}')}
    threading.Timer(0.5, lambda: setattr(fakes["a"], "lock_info", None)).start()
    (r,) = runner(fakes, lock_wait=10).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.CHANGED
