"""Deploy orchestration against scripted hosts: results, recap, exit codes, locks, round trips.

The scripted hosts answer typed commands, including the readiness watch and the instance probes (real
simulator start-up lines, HTTP answers made "on the host"), so these flows exercise verification too.
"""

from __future__ import annotations

import _thread
import getpass
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.results import Status, exit_code, recap_counts
from ernie_deploy.planning.findings import Finding
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.remote.command import Command, Op
from ernie_deploy.remote.lock import LockInfo


def inventory(tmp_path: Path, hosts: dict[str, dict]) -> list:  # type: ignore[type-arg]
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1"},
                    "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return list(load_inventory(path).select(None))


def runner(fakes: dict[str, FakeHost], **opts: object) -> Runner:
    settings: dict[str, object] = {"health_timeout": 5, "stable": 0, "poll": 0.01, **opts}
    return Runner(PlanContext.load(), connector(fakes), Options(**settings))  # type: ignore[arg-type]


def test_first_deploy_changes_then_second_is_a_no_op(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    hosts = inventory(tmp_path, {"a": {}, "b": {}})
    first = runner(fakes).run(hosts)
    assert [r.status for r in first] == [Status.CHANGED, Status.CHANGED]
    assert sorted(fakes["a"].files) == ["/etc/ernie-deploy/ernie-vllm-0.env",
                                        "/etc/systemd/system/ernie-vllm-0.service"]
    assert first[0].change.started == ["ernie-vllm-0.service"] and exit_code(first) == ExitCode.OK
    assert fakes["a"].lock_info is None  # released
    second = runner(fakes).run(hosts)
    assert [r.status for r in second] == [Status.OK, Status.OK]
    # One connection and one command: the facts, read without the lock since nothing is to change.
    assert [r.commands for r in second] == [1, 1] and second[0].command_log == ["gather facts"]
    assert len(fakes["a"].applied) == 1 and fakes["a"].active["ernie-vllm-0.service"] == 1


def test_changed_variable_restarts_only_that_host(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    results = runner(fakes).run(inventory(tmp_path, {"a": {"vllm_max_model_len": 2048}, "b": {}}))
    assert [r.status for r in results] == [Status.CHANGED, Status.OK]
    assert results[0].change.restarted == ["ernie-vllm-0.service"]
    assert results[0].change.changed_files == ["/etc/systemd/system/ernie-vllm-0.service"]
    assert fakes["a"].active["ernie-vllm-0.service"] == 2 and fakes["b"].active["ernie-vllm-0.service"] == 1


def test_check_mode_changes_nothing_and_takes_no_lock(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    results = runner(fakes, check=True, diff=True).run(inventory(tmp_path, {"a": {}}))
    assert results[0].status is Status.CHANGED and "check mode" in results[0].message
    assert fakes["a"].files == {} and fakes["a"].applied == [] and fakes["a"].lock_info is None
    assert results[0].command_log == ["gather facts"]
    assert any("+ExecStart=" in d for d in results[0].change.diffs)


def test_unreachable_host_does_not_stop_the_others(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(unreachable=True), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    assert [r.status for r in results] == [Status.UNREACHABLE, Status.CHANGED]
    assert exit_code(results) == ExitCode.UNREACHABLE
    assert recap_counts(results[0]) == {"ok": 0, "changed": 0, "unreachable": 1, "failed": 0, "skipped": 0}


def test_a_host_that_stops_answering_mid_change_is_unreachable_and_its_lock_named_stale(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(silent_from=Op.WATCH), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    assert [r.status for r in results] == [Status.UNREACHABLE, Status.CHANGED]
    assert exit_code(results) == ExitCode.UNREACHABLE
    assert "answered nothing for 60s" in results[0].message
    # the release was tried once and not waited for: the lock stays, named for what it will look like
    assert fakes["a"].lock_info is not None and [c.op for c in fakes["a"].received].count(Op.RELEASE_LOCK) == 1
    assert ("could not release the deploy lock on a: host not answering; it will show as stale (once a answers "
            "and no deploy runs: ernie-deploy lock -i INV --limit a --break)") in results[0].evidence


def test_locks_left_by_a_dead_run_name_one_command_that_breaks_them_all(tmp_path: Path) -> None:
    dead = LockInfo("0" * 32, getpass.getuser(), socket.gethostname(), 2**22 + 7, "ernie-deploy deploy", 1.0)
    assert dead.liveness() == "dead"
    fakes = {"a": FakeHost(lock_info=dead.to_json()), "b": FakeHost(lock_info=dead.to_json())}
    results = runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    assert [r.status for r in results] == [Status.LOCKED, Status.LOCKED]
    assert all("`ernie-deploy lock -i INV --break` breaks every such lock at once" in (r.hint or "") for r in results)


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
    assert results[1].status is Status.CHANGED and exit_code(results) == ExitCode.FAILED


def test_bad_jump_host_fails_only_that_host_before_connecting(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {"a": {"ansible_ssh_common_args": "-J bastion:99999"},
                                                     "b": {}}))
    assert results[0].status is Status.FAILED and "ansible_ssh_common_args" in results[0].message
    assert "'bastion:99999' is not [user@]host[:port]" in results[0].message
    assert fakes["a"].files == {} and fakes["a"].lock_info is None and results[0].commands == 0
    assert results[1].status is Status.CHANGED and exit_code(results) == ExitCode.FAILED

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
    assert r.status is Status.LOCKED and exit_code([r]) == ExitCode.LOCKED
    assert "alice@ops1 (pid 7)" in r.message and "--lock-wait" in (r.hint or "")
    assert fakes["a"].lock_info == other and fakes["a"].files == {}


def test_lock_wait_retries_until_released(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(lock_info='{"token": "f00", "user": "x", "controller": "y", "pid": 1, "since": 0, '
                                     '"command": "c"}')}
    threading.Timer(0.5, lambda: setattr(fakes["a"], "lock_info", None)).start()
    (r,) = runner(fakes, lock_wait=10).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.CHANGED


def test_deploy_watches_and_checks_every_started_instance(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.CHANGED and r.message == "changed; every (re)started instance verified"
    names = [s.name for s in r.steps]
    # Facts read without the lock, then (something to change) the lock taken and the facts read again.
    assert names == ["connect", "facts", "plan", "lock + facts", "stage", "gpu release ernie-vllm-0",
                     "start ernie-vllm-0", "ready ernie-vllm-0", "checks"]
    by_name = {c.name: c for c in r.checks}
    assert by_name["http_models"].status == "pass" and by_name["tensor_parallel"].status == "pass"
    assert r.change.release and r.change.release == fakes["a"].releases[0]["id"]


def test_an_instance_that_serves_the_wrong_length_fails_the_host(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(serve_len=1024)}  # /v1/models disagrees with the plan's max_model_len
    (r,) = runner(fakes, health_timeout=0.3).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.FAILED and "ernie-vllm-0 not ready within the start-up budget" in r.message
    assert [s.status for s in r.steps if s.name == "ready ernie-vllm-0"] == ["failed"]


def test_missing_restart_marker_is_a_failure_not_verified(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(restart_marker=False)}
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.FAILED and "no start marker" in r.message
    assert "instance verified" not in r.message and fakes["a"].lock_info is None


def test_unexpected_exception_is_one_failed_host_and_the_others_finish(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(fail_on=Op.STAGE), "b": FakeHost()}
    results = runner(fakes).run(inventory(tmp_path, {"a": {}, "b": {}}))
    assert results[0].status is Status.FAILED and "unexpected error: ValueError" in results[0].message
    assert "-vvv" in (results[0].hint or "") and fakes["a"].lock_info is None
    assert results[1].status is Status.CHANGED


def test_ctrl_c_prints_every_host_and_releases_every_lock(tmp_path: Path) -> None:
    class Interrupting(FakeHost):
        def probe(self, cmd: Command) -> str:
            if cmd.op is Op.WATCH and not getattr(self, "sent", False):
                self.sent = True
                _thread.interrupt_main()  # exactly what Ctrl-C does: KeyboardInterrupt in the main thread
                time.sleep(0.3)
            return super().probe(cmd)

    fakes = {"a": Interrupting(), "b": FakeHost(), "c": FakeHost()}
    run = runner(fakes, forks=1, stable=10)  # still watching a when Ctrl-C comes
    results = run.run(inventory(tmp_path, {"a": {}, "b": {}, "c": {}}))
    assert run.stopped_by == signal.SIGINT and exit_code(results, run.stopped_by) == ExitCode.INTERRUPTED
    assert [r.host for r in results] == ["a", "b", "c"]
    assert results[0].status is Status.FAILED and "interrupted" in results[0].message
    # an interrupt is not a failed start
    assert "not verified" in results[0].message and not results[0].change.rollbacks
    assert {r.status for r in results[1:]} <= {Status.SKIPPED, Status.CHANGED}
    assert all(f.lock_info is None for f in fakes.values())


def test_a_held_lock_is_reported_even_when_nothing_is_to_change(tmp_path: Path) -> None:
    """The first read takes no lock, but it sees one: a host another run holds is LOCKED, as before."""
    fakes = {"a": FakeHost()}
    hosts = inventory(tmp_path, {"a": {}})
    runner(fakes).run(hosts)
    fakes["a"].lock_info = json.dumps({"token": "f" * 32, "user": "ops", "controller": "elsewhere", "pid": 1,
                                       "command": "ernie-deploy restart", "since": 0})
    (r,) = runner(fakes).run(hosts)
    assert r.status is Status.LOCKED and "ernie-deploy restart" in r.message
    assert fakes["a"].lock_info is not None and "elsewhere" in fakes["a"].lock_info  # not ours to release


def test_a_change_found_by_the_unlocked_read_is_made_under_the_lock(tmp_path: Path) -> None:
    """The first read (no lock) finds a unit edited by hand: the lock is taken and the facts read again in one
    round trip before anything is staged (and, the snapshot being old here, read once more under it)."""
    fakes = {"a": FakeHost()}
    hosts = inventory(tmp_path, {"a": {}})
    runner(fakes).run(hosts)
    fakes["a"].files["/etc/systemd/system/ernie-vllm-0.service"] += "# edited by hand\n"
    (r,) = runner(fakes, recheck_after=0).run(hosts)
    assert r.status is Status.CHANGED
    # The pre-flight reads the GPUs of the instance to restart (a stray process there would keep it down).
    assert r.command_log[:4] == ["gather facts", "lock + gather facts", "read GPU release", "gather facts"]
    assert fakes["a"].lock_info is None  # taken, then released


def test_unknown_command_is_answered_with_a_failure() -> None:
    from ernie_deploy.remote.command import script
    from ernie_deploy.remote.ssh import RemoteError, Target

    session = connector({"a": FakeHost()})(Target("a", "127.0.0.1"))
    with pytest.raises(RemoteError):
        session.run(script("systemctl restart everything"))


def test_facts_are_rechecked_before_changing_an_old_snapshot(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    (r,) = runner(fakes, recheck_after=0).run(inventory(tmp_path, {"a": {}}))
    assert r.command_log[:5] == ["gather facts", "lock + gather facts", "gather facts", "list releases",
                                 "stage files"]
    assert "facts (re-checked)" in [s.name for s in r.steps]


def test_stage_records_a_release_of_every_managed_file(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    two = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}
    runner(fakes).run(inventory(tmp_path, {"a": two}))
    runner(fakes).run(inventory(tmp_path, {"a": {**two, "vllm_max_model_len": 2048}}))
    first, second = fakes["a"].releases
    assert sorted(first["files"]) == sorted(fakes["a"].files) and len(first["files"]) == 4
    assert re.fullmatch(r"\d{8}T\d{6}\.\d{3}Z-[0-9a-f]{8}", second["id"]) and second["id"] != first["id"]
    assert second["changed"] == ["/etc/systemd/system/ernie-vllm-0.service",
                                 "/etc/systemd/system/ernie-vllm-1.service"]


def test_deploy_uses_custom_templates(tmp_path: Path) -> None:
    from ernie_deploy.planning.render import templates_dir

    mine = tmp_path / "tpl"
    mine.mkdir()
    for f in templates_dir().iterdir():
        (mine / f.name).write_text(f.read_text())
    (mine / "vllm.service.j2").write_text("# site template\n" + (mine / "vllm.service.j2").read_text())
    fakes = {"a": FakeHost()}
    runner(fakes, templates=mine).run(inventory(tmp_path, {"a": {}}))
    assert fakes["a"].files["/etc/systemd/system/ernie-vllm-0.service"].startswith("# site template\n")


def test_model_unreadable_by_the_service_user_fails_before_anything_changes(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(model_readable=False)}
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.FAILED and fakes["a"].files == {}
    assert "not readable by vllm_user 'vllm'" in r.findings[0].message and "chmod" in (r.findings[0].fix or "")


def test_a_stop_that_ended_in_sigkill_is_reported(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(killed_on_stop=True)}
    runner(fakes).run(inventory(tmp_path, {"a": {}}))
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {"vllm_max_model_len": 2048}}))
    (stop,) = [c for c in r.checks if c.name == "stop"]
    assert stop.status == "warn" and "SIGKILL" in stop.summary and "in flight" in stop.summary


def test_a_lock_left_by_a_dead_process_on_this_controller_is_named_stale(tmp_path: Path) -> None:
    import json
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a pid that has just ended
    holder = json.dumps({"command": "ernie-deploy deploy", "controller": socket.gethostname(), "pid": int(gone),
                         "since": 0, "token": "f00", "user": "alice"})
    fakes = {"a": FakeHost(lock_info=holder)}
    (r,) = runner(fakes).run(inventory(tmp_path, {"a": {}}))
    assert r.status is Status.LOCKED and "stale" in r.message and "--break" in (r.hint or "")


def test_breaking_a_lock_whose_holder_may_run_needs_force(tmp_path: Path) -> None:
    import json
    import os
    import socket

    from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
    from ernie_deploy.orchestration.hosts import lock_state

    alive = json.dumps({"command": "c", "controller": socket.gethostname(), "pid": os.getpid(), "since": 0,
                        "token": "f00", "user": "u"})
    fakes = {"a": FakeHost(lock_info=alive)}
    hosts = inventory(tmp_path, {"a": {}})
    ((r, _),) = lock_state(Fleet(connector(fakes), FleetOptions()), hosts, break_=True)
    assert r.status is Status.FAILED and "--force" in (r.hint or "") and fakes["a"].lock_info == alive
    ((r, state),) = lock_state(Fleet(connector(fakes), FleetOptions()), hosts, break_=True, force=True)
    assert r.status is Status.CHANGED and state.startswith("broke lock held by") and fakes["a"].lock_info is None


def test_each_host_is_planned_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deploy reads each host's inventory and builds its plan once, though a changing host has its facts read
    twice (without the lock, then with it)."""
    from ernie_deploy.planning import plan as planning

    reads: list[str] = []
    builds: list[str] = []
    read, check = planning.inventory_settings, planning.unsafe_values

    def counted_read(host_vars: dict[str, object], where: str) -> dict[str, object]:
        reads.append(where)
        return read(host_vars, where)

    def counted_build(plan: HostPlan) -> list[Finding]:
        builds.append(plan.name)
        return check(plan)

    monkeypatch.setattr(planning, "inventory_settings", counted_read)
    monkeypatch.setattr(planning, "unsafe_values", counted_build)
    results = runner({"a": FakeHost(), "b": FakeHost()}).run(inventory(tmp_path, {"a": {}, "b": {}}))
    assert [r.status for r in results] == [Status.CHANGED, Status.CHANGED]
    assert sorted(reads) == ["a", "b"] and sorted(builds) == ["a", "b"]
