"""status's pure parts (the host's process list, the `vllm serve` test, the unit word round trip, logs' split,
the last change as printed), and status against a scripted host: locks, pending units, the vLLM that runs."""

import base64
import json
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from fakehost import FakeHost, connector
from hypothesis import given
from hypothesis import strategies as st

from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.details import StatusReport
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.orchestration.results import HostResult, Status, exit_code
from ernie_deploy.orchestration.status import StatusReader
from ernie_deploy.output.status import show_status
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.planning.render import systemd_word, unescape_word
from ernie_deploy.remote import logs
from ernie_deploy.remote.lock import LockInfo
from ernie_deploy.remote.protocol import MARK
from ernie_deploy.remote.status import parse


def _b64(*argv: str) -> str:
    return base64.b64encode(("\x1f".join(argv) + "\x1f").encode()).decode()


def test_processes_are_read_with_their_arguments_and_cgroup() -> None:
    text = (f"{MARK}status-main\nernie-vllm-0.service 42\n{MARK}status-procs\n"
            f"42 {_b64('/opt/vllm/0.34.0/bin/python', '/opt/vllm/0.34.0/bin/vllm', 'serve', '/m', '--port', '8000')} "
            "/system.slice/ernie-vllm-0.service\n"
            f"77 {_b64('sh', '-c', 'grep serve x')} /user.slice/session-3.scope\n"
            f"90 {_b64('vllm', 'serve', 'my model')} /user.slice/session-3.scope\n{MARK}status-end\n")
    seen = parse(text)
    assert seen.main_pids == {"ernie-vllm-0.service": 42}
    assert seen.procs[42].serve_args == ("/m", "--port", "8000") and seen.procs[42].unit == "ernie-vllm-0.service"
    assert seen.procs[77].serve_args is None  # a shell whose script mentions serve is not vLLM
    assert seen.procs[90].serve_args == ("my model",) and seen.procs[90].unit is None


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1))
def test_unescape_inverts_the_unit_files_escaping(value: str) -> None:
    assert unescape_word(systemd_word(value, "x", "h")) == value


def test_logs_split_keeps_the_cursor_apart() -> None:
    text = "invocation abc\n2026-12-04T04:00:00+0000 h vllm[1]: INFO ready\n-- cursor: s=1;i=2\n"
    assert logs.split(text) == ("abc", ["2026-12-04T04:00:00+0000 h vllm[1]: INFO ready"], "s=1;i=2")
    assert logs.split("invocation abc\n-- No entries --\n") == ("abc", [], None)


def test_status_never_prints_none_for_an_audit_line_without_user_or_controller(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Audit lines written before every change carried user and controller (a playbook's command task) still
    read as a last change."""
    last = {"time": "2026-01-05T10:00:00Z", "user": None, "controller": None, "command": "ernie-deploy run (x)",
            "action": "command"}
    show_status([HostResult("a")], {"a": StatusReport(last_change=last)}, 0, json=False)
    out = capsys.readouterr().out
    assert "None" not in out and "last change 2026-01-05T10:00:00Z ? ernie-deploy run (x) (command)" in out


# -- status against a scripted host ----------------------------------------------------------------------------

def _hosts(tmp_path: Path, host_vars: dict[str, object] | None = None) -> list[Host]:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1"}, "hosts": {"a": host_vars or {}}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return list(load_inventory(path).select(None))


def _deployed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeHost, list[Host]]:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    fake, hosts = FakeHost(), _hosts(tmp_path)
    opts = Options(health_timeout=5.0, stable=0.0, poll=0.01,
                   cycle=CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01))
    (r,) = Runner(PlanContext.load(), connector({"a": fake}), opts).run(hosts)
    assert r.status is Status.CHANGED, r.message
    return fake, hosts


def _status(fake: FakeHost, hosts: list[Host]) -> tuple[HostResult, StatusReport]:
    reader = StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions()))
    (r,) = reader.run(hosts)
    return r, reader.reports["a"]


def test_a_deployed_host_has_no_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r, report = _status(*_deployed(tmp_path, monkeypatch))
    assert r.status is not Status.FAILED and not report.drift, report.drift
    assert report.vllm == "0.34.0" and report.vllm_line() == "0.34.0"


def test_a_stale_lock_is_drift_with_the_one_command_that_breaks_them_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """kill -9 of a deploy leaves its lock behind: status must not say "no drift" while every deploy is refused."""
    fake, hosts = _deployed(tmp_path, monkeypatch)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs on this controller
    fake.lock_info = LockInfo("t0k3n", "ops", socket.gethostname(), gone.pid, "ernie-deploy deploy", 1.7e9).to_json()
    r, report = _status(fake, hosts)
    assert r.status is Status.FAILED and exit_code([r]) == ExitCode.FAILED
    (drift,) = report.drift
    assert drift.kind == "lock" and "stale" in drift.message and f"pid {gone.pid}" in drift.message
    assert drift.fix.startswith("ernie-deploy lock -i INV --break") and "--limit" not in drift.fix
    show_status([r], {"a": report}, 2, json=False)
    out = capsys.readouterr().out
    assert "drift [lock] stale deploy lock" in out and "no drift" not in out


def test_a_lock_held_from_another_controller_needs_force_for_that_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    fake.lock_info = LockInfo("t0k3n", "ops", "elsewhere.example", 1, "ernie-deploy restart", 1.7e9).to_json()
    (drift,) = _status(fake, hosts)[1].drift
    assert drift.kind == "lock" and "another controller" in drift.message and "--force --limit a" in drift.fix
    fake.lock_info = "{half"  # a run died while taking it
    (drift,) = _status(fake, hosts)[1].drift
    assert drift.kind == "lock" and "without readable details" in drift.message


def test_a_pending_entry_left_after_the_restart_is_not_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller died after the restart, before it cleared the pending entry: what runs says the staged
    files run (the process started after they arrived), so nothing waits for a restart."""
    fake, hosts = _deployed(tmp_path, monkeypatch)
    unit = "ernie-vllm-0.service"
    fake.pending.add(unit)
    fake.wall_now = 100_000.0  # the fake's processes started 1000 s before: at 99 000
    fake.ctimes = {f"/etc/systemd/system/{unit}": 98_000, "/etc/ernie-deploy/ernie-vllm-0.env": 98_000}
    assert not _status(fake, hosts)[1].drift
    # Staged (or restored) after the process started: it really waits.
    fake.ctimes[f"/etc/systemd/system/{unit}"] = 99_500
    (drift,) = _status(fake, hosts)[1].drift
    assert drift.kind == "pending" and "wait for a restart" in drift.message
    # Nothing to judge by (no clock, no times): the list is believed.
    fake.wall_now = None
    assert [d.kind for d in _status(fake, hosts)[1].drift] == ["pending"]


def test_status_reports_the_vllm_the_process_runs_and_the_installed_one_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """After a rollback to a release of another vllm_version, the default path has 0.33.0 and 0.34.0 runs."""
    fake, hosts = _deployed(tmp_path, monkeypatch)
    fake.vllm = "0.33.0"
    fake.running_vllm = {"ernie-vllm-0.service": "0.34.0"}
    r, report = _status(fake, hosts)
    assert report.vllm == "0.34.0" and report.vllm_installed == "0.33.0"
    assert report.instances[0]["vllm"] == "0.34.0"
    show_status([r], {"a": report}, 0, json=False)
    out = capsys.readouterr().out
    assert "vLLM 0.34.0 running (0.33.0 installed)" in out and "pid 1000 vLLM 0.34.0" in out
    show_status([r], {"a": report}, 0, json=True)
    host = json.loads(capsys.readouterr().out)["hosts"]["a"]
    assert host["vllm"] == "0.34.0" and host["vllm_installed"] == "0.33.0" and host["instances"][0]["vllm"] == "0.34.0"
