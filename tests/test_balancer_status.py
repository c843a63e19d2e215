"""status with the fleet's balancers: each instance's server as every balancer sees it, each balancer's row, and
the drift between them (out of rotation while serving, unknown to the live configuration, unreadable balancer),
against a scripted vLLM host and a scripted balancer view."""

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from fakehost import FakeBalancer, FakeHost, FakeServer, connector

from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.balancers import Balancers, ServerStat
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.orchestration.results import HostResult, Status, exit_code
from ernie_deploy.orchestration.status import (
    DEPLOY_BALANCERS,
    BalancerReport,
    BalancerView,
    StatusReader,
    in_rotation,
    instance_view,
    read_balancers,
)
from ernie_deploy.output.schemas import STATUS_SCHEMA
from ernie_deploy.output.status import show_status
from ernie_deploy.planning.balancer import BalancerBackend, BalancerPlan, BalancerServer
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.remote.balancer import parse_stat

UP = ServerStat("UP", 0, 1)
SOCKET = "/run/haproxy/admin.sock"


class View:
    """A scripted `Balancers.all_stats`: what each balancer's `show stat` listed, or its problem."""

    def __init__(self, answers: Mapping[str, Mapping[str, ServerStat] | str]) -> None:
        self.answers = dict(answers)
        self.calls = 0

    def all_stats(self) -> Mapping[str, Mapping[str, ServerStat] | str]:
        self.calls += 1
        return self.answers


def lb(host: str = "lb-1", servers: tuple[str, ...] = ("a-0", "a-1"), socket: str = SOCKET) -> BalancerPlan:
    members = tuple(BalancerServer(name, name.rsplit("-", 1)[0], int(name.rsplit("-", 1)[1]),
                                   f"ernie-vllm-{name.rsplit('-', 1)[1]}", "10.0.0.5", 8000 + int(name[-1]), 1)
                    for name in servers)
    return BalancerPlan(host, "127.0.0.9", "0.0.0.0", 8080, socket, "/etc/haproxy/haproxy.cfg", 2.0,
                        (BalancerBackend("ernie", "ernie-4.5", members),))


# -- against a scripted vLLM host ------------------------------------------------------------------------------

def _deployed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeHost, list[Host]]:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_instances": 2,
                             "vllm_tensor_parallel_size": 1}, "hosts": {"a": {}}}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(data))
    fake, hosts = FakeHost(), list(load_inventory(tmp_path / "inv.yml").select(None))
    opts = Options(health_timeout=5.0, stable=0.0, poll=0.01,
                   cycle=CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01))
    (r,) = Runner(PlanContext.load(), connector({"a": fake}), opts).run(hosts)
    assert r.status is Status.CHANGED, r.message
    return fake, hosts


def _status(fake: FakeHost, hosts: list[Host], view: View, plans: tuple[BalancerPlan, ...] = (lb(),)
            ) -> tuple[StatusReader, list[HostResult]]:
    reader = StatusReader(PlanContext.load(), Fleet(connector({"a": fake}), FleetOptions()),
                          balancers=view, balancer_plans=plans)
    return reader, reader.run(hosts)


def _show(reader: StatusReader, results: list[HostResult], capsys: pytest.CaptureFixture[str], *,
          json_out: bool = False, verbose: bool = False) -> str:
    capsys.readouterr()
    show_status(results, reader.reports, exit_code(results), json=json_out, balancers=reader.balancer_reports,
                verbose=verbose)
    return capsys.readouterr().out


def test_every_instance_in_rotation_is_no_drift_and_each_balancer_has_its_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    reader, results = _status(fake, hosts, View({"lb-1": {"a-0": ServerStat("UP", 3, 1), "a-1": UP}}))
    assert [r.host for r in results] == ["a", "lb-1"] and exit_code(results) == ExitCode.OK
    assert not reader.reports["a"].drift and not reader.balancer_reports["lb-1"].drift
    assert results[1].status is Status.OK and results[1].message == "HAProxy answers; 2 of 2 planned server(s) UP"
    out = _show(reader, results, capsys)
    assert "(GPUs 0, port 8000)\n      balancers: lb-1 UP\n" in out
    assert "lb-1: haproxy on 0.0.0.0:8080, 2 of 2 planned server(s) UP" in out
    assert "    backend ernie (model ernie-4.5): a-0 UP, a-1 UP" in out and "sessions" not in out
    verbose = _show(reader, results, capsys, verbose=True)
    assert "balancers: lb-1 UP (3 sessions, weight 1)\n" in verbose and "a-1 UP (0 sessions, weight 1)" in verbose


def test_json_v3_has_each_instances_server_and_each_balancer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    view = View({"lb-1": {"a-0": ServerStat("DRAIN", 2, 0), "a-1": UP, "old-0": UP}})
    reader, results = _status(fake, hosts, view)
    doc = json.loads(_show(reader, results, capsys, json_out=True))
    assert doc["schema"] == STATUS_SCHEMA == "ernie-deploy/status/v5" and doc["exit_code"] == ExitCode.FAILED
    assert list(doc["hosts"]) == ["a"]  # a balancer is not a vLLM host
    first = doc["hosts"]["a"]["instances"][0]
    assert first["index"] == 0 and first["balancers"] == {"lb-1": {
        "server": "a-0", "configured": True, "status": "DRAIN", "sessions": 2, "weight": 0, "in_rotation": False}}
    row = doc["balancers"]["lb-1"]
    assert row["error"] is None and row["listen"] == "0.0.0.0:8080" and row["admin_socket"] == SOCKET
    assert row["planned"] == 2 and row["up"] == 1 and row["kind"] == "haproxy"
    assert row["servers"]["a-1"] == {"backend": "ernie", "planned": True, "configured": True, "status": "UP",
                                     "sessions": 0, "weight": 1, "in_rotation": True}
    assert row["servers"]["old-0"]["planned"] is False and row["servers"]["old-0"]["backend"] is None
    assert [d["kind"] for d in row["drift"]] == ["balancer-config"]
    assert [d["kind"] for d in doc["hosts"]["a"]["drift"]] == ["balancer"]


def _run_fix(fix: str, tmp_path: Path) -> list[str]:
    """Runs a fix's command with a stand-in `socat` on PATH: the arguments it got, then the line it read."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "socat").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\ncat\n')
    (bin_dir / "socat").chmod(0o755)
    command = fix.split(" as root: ", 1)[1]
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    return run.stdout.splitlines()


def test_a_serving_instance_left_drained_is_drift_with_haproxys_own_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A rollout stopped between drain and ready leaves the server drained: the instance serves, the balancer
    sends it nothing, and nothing but `state ready` ends that."""
    fake, hosts = _deployed(tmp_path, monkeypatch)
    reader, results = _status(fake, hosts, View({"lb-1": {"a-0": ServerStat("DRAIN", 0, 0),
                                                          "a-1": ServerStat("MAINT", 0, 0)}}))
    assert results[0].status is Status.FAILED and exit_code(results) == ExitCode.FAILED
    drained, maint = reader.reports["a"].drift
    assert (drained.kind, drained.subject) == ("balancer", "lb-1/a-0")
    assert "a-0 serves but is out of rotation on lb-1 (DRAIN): drained" in drained.message
    assert drained.fix == (f"on lb-1 as root: echo 'set server ernie/a-0 state ready' | socat stdio {SOCKET}"
                           "  # socat: apt-get install socat")
    assert "in maintenance" in maint.message and "set server ernie/a-1 state ready" in maint.fix
    # The fix runs as written: socat gets the socket and HAProxy's command as its one line.
    assert _run_fix(drained.fix, tmp_path) == ["stdio", SOCKET, "set server ernie/a-0 state ready"]
    out = _show(reader, results, capsys)
    assert "balancers: lb-1 DRAIN\n" in out
    assert "drift [balancer] a-0 serves but is out of rotation" in out
    assert "lb-1: haproxy on 0.0.0.0:8080, 0 of 2 planned server(s) UP" in out


def test_a_serving_instance_the_balancer_marks_down_names_the_address_it_checks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    reader, _ = _status(fake, hosts, View({"lb-1": {"a-0": UP, "a-1": ServerStat("DOWN 1/2", 0, 1)}}))
    (down,) = reader.reports["a"].drift
    assert "a-1 serves but lb-1 (DOWN 1/2) fails its health check (a completion request to 10.0.0.5:8001)" \
        in down.message
    assert "lb-1 reaches 10.0.0.5:8001" in down.fix and down.fix.endswith(DEPLOY_BALANCERS)


def test_a_completion_check_that_timed_out_on_a_serving_instance_is_a_hung_engine_not_the_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    reader, _ = _status(fake, hosts, View({"lb-1": {"a-0": UP, "a-1": ServerStat("DOWN", 0, 1, "L7TOUT")}}))
    (down,) = reader.reports["a"].drift
    assert down.message.startswith("a-1 is not generating: lb-1 (DOWN) marks it down because its completion check "
                                   "to 10.0.0.5:8001 timed out (Layer7 timeout) while its /health answers 200")
    assert "firewall" not in down.fix and down.fix.startswith("restart it: ernie-deploy restart -i INV --limit a "
                                                              "--instance 1")


def test_show_stat_gives_each_servers_last_check_result() -> None:
    text = ("# pxname,svname,qcur,scur,status,weight,check_status,check_code\n"
            "vllm,a-0,0,2,UP,1,L7OK,200\nvllm,a-1,0,0,DOWN,1,* L7TOUT,\nvllm,BACKEND,0,2,UP,2,,\n")
    stats = parse_stat(text)
    assert stats[("vllm", "a-0")].check_status == "L7OK" and stats[("vllm", "a-1")].check_status == "L7TOUT"
    assert ("vllm", "BACKEND") not in stats


def test_an_instance_the_live_configuration_lacks_is_named_on_the_instance_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The balancer was not deployed since the host got its second instance: the instance serves, unbalanced."""
    fake, hosts = _deployed(tmp_path, monkeypatch)
    reader, results = _status(fake, hosts, View({"lb-1": {"a-0": UP}}))
    (unknown,) = reader.reports["a"].drift
    assert (unknown.kind, unknown.subject) == ("balancer-config", "lb-1/a-1")
    assert "lb-1's live HAProxy configuration has no server a-1" in unknown.message
    assert unknown.fix == "ernie-deploy deploy -i INV --limit vllm_balancers"
    assert not reader.balancer_reports["lb-1"].drift  # named once, on the instance its host row shows
    out = _show(reader, results, capsys)
    assert "balancers: lb-1 not configured\n" in out and "a-1 not configured" in out


def test_an_unreadable_balancer_is_unreachable_and_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    problem = "lb-2: HAProxy's admin socket /run/haproxy/admin.sock is missing: deploy the balancer first"
    view = View({"lb-1": {"a-0": UP, "a-1": UP}, "lb-2": problem})
    reader, results = _status(fake, hosts, view, (lb(), lb("lb-2")))
    assert exit_code(results) == ExitCode.UNREACHABLE and view.calls == 1
    assert results[0].status is Status.OK and not reader.reports["a"].drift  # the balancer's row names it
    assert (results[2].host, results[2].status, results[2].message) == ("lb-2", Status.UNREACHABLE, problem)
    out = _show(reader, results, capsys)
    assert "balancers: lb-1 UP, lb-2 ? (not read)\n" in out
    assert f"lb-2: haproxy on 0.0.0.0:8080, not read: {problem}" in out
    doc = json.loads(_show(reader, results, capsys, json_out=True))
    assert doc["exit_code"] == ExitCode.UNREACHABLE and doc["balancers"]["lb-2"]["error"] == problem
    assert doc["balancers"]["lb-2"]["up"] is None and doc["balancers"]["lb-2"]["servers"]["a-0"]["configured"] is None
    assert doc["hosts"]["a"]["instances"][0]["balancers"]["lb-2"]["status"] is None


def test_a_balancer_the_view_does_not_answer_for_is_a_problem_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    _, results = _status(fake, hosts, View({}))
    assert results[1].status is Status.UNREACHABLE and results[1].message == "lb-1: the balancer was not read"


def test_without_balancers_status_reads_none_and_its_rows_are_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, hosts = _deployed(tmp_path, monkeypatch)
    view = View({})
    reader, results = _status(fake, hosts, view, ())
    assert [r.host for r in results] == ["a"] and view.calls == 0
    out = _show(reader, results, capsys)
    assert "(GPUs 0, port 8000)\n" in out and "no drift" in out
    assert json.loads(_show(reader, results, capsys, json_out=True))["balancers"] == {}


def test_only_the_balancers_selected_name_missing_servers_on_their_own_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`status --limit vllm_balancers`: no vLLM host is read, so a planned server the live configuration lacks
    is the balancer's drift."""
    fake, _ = _deployed(tmp_path, monkeypatch)
    reader, results = _status(fake, [], View({"lb-1": {"a-0": UP}}))
    (missing,) = reader.balancer_reports["lb-1"].drift
    assert missing.message == "lb-1's live HAProxy configuration lacks planned server(s): a-1"
    assert [r.status for r in results] == [Status.FAILED] and exit_code(results) == ExitCode.FAILED


def test_status_reads_the_balancers_through_their_ssh_door(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `Balancers` over scripted balancer hosts: HAProxy's `show stat` through the admin program, and a
    balancer whose admin socket is missing."""
    fake, hosts = _deployed(tmp_path, monkeypatch)
    lb1 = FakeHost(balancer=FakeBalancer(servers={("ernie", "a-0"): FakeServer("DRAIN", 0, 0),
                                                  ("ernie", "a-1"): FakeServer(),
                                                  ("ernie", "old-0"): FakeServer()}))
    lb2 = FakeHost(balancer=FakeBalancer(socket="missing"))
    plans = (lb(), lb("lb-2"))
    fleet = Fleet(connector({"a": fake, "lb-1": lb1, "lb-2": lb2}), FleetOptions())
    balancers = Balancers(fleet, plans, {p.host: Host(p.host, {"ansible_host": "127.0.0.1", "ansible_user": "root"})
                                         for p in plans})
    view: BalancerView = balancers
    try:
        reader = StatusReader(PlanContext.load(), fleet, balancers=view, balancer_plans=plans)
        results = reader.run(hosts)
    finally:
        balancers.close()
    assert [(r.host, r.status) for r in results] == [("a", Status.FAILED), ("lb-1", Status.FAILED),
                                                     ("lb-2", Status.UNREACHABLE)]
    (drained,) = reader.reports["a"].drift
    assert drained.subject == "lb-1/a-0" and "set server ernie/a-0 state ready" in drained.fix
    assert results[2].message.startswith("lb-2: ") and exit_code(results) == ExitCode.UNREACHABLE
    assert lb1.balancer is not None and not [e for e in lb1.balancer.log if e.startswith("set")]  # read only
    # A server lb-1 runs that the plan no longer has (a host taken out of the inventory) is drift on its row.
    (extra,) = reader.balancer_reports["lb-1"].drift
    assert (extra.kind, extra.subject) == ("balancer-config", "lb-1") and extra.message.endswith(": old-0")


# -- the pure parts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "rotating"), [("UP", True), ("UP 1/2", True), ("no check", True),
                                                  ("DRAIN", False), ("MAINT", False), ("MAINT(via)", False),
                                                  ("DOWN", False), ("DOWN 1/2", False), ("NOLB", False)])
def test_in_rotation_follows_haproxys_status_words(status: str, rotating: bool) -> None:
    assert in_rotation(ServerStat(status, 0, 1)) is rotating


def test_an_instance_that_does_not_serve_is_expected_out_of_rotation() -> None:
    """A failed start leaves it drained on purpose (its own drift says it is down); --resume readies it."""
    (read,) = read_balancers([lb()], View({"lb-1": {"a-0": ServerStat("DRAIN", 0, 0), "a-1": UP}}), {"a"})
    columns, drift = instance_view("a", 0, False, [read])
    assert columns["lb-1"]["status"] == "DRAIN" and drift == []
    assert instance_view("a", 0, True, [read])[1][0].kind == "balancer"


def test_the_ready_command_quotes_what_it_cannot_pass_bare(tmp_path: Path) -> None:
    socket = "/run/ha proxy/$(touch pwned)'x.sock"
    (read,) = read_balancers([lb(socket=socket)], View({"lb-1": {"a-0": ServerStat("DRAIN", 0, 0), "a-1": UP}}),
                             {"a"})
    (drift,) = instance_view("a", 0, True, [read])[1]
    assert _run_fix(drift.fix, tmp_path) == ["stdio", socket, "set server ernie/a-0 state ready"]
    assert not (tmp_path / "pwned").exists()


def test_a_server_the_plan_lacks_but_haproxy_drains_is_fixed_by_deploying_the_balancer() -> None:
    """Its backend is unknown here, so no runtime command can be written for it."""
    (read,) = read_balancers([lb(servers=("a-1",))], View({"lb-1": {"a-0": ServerStat("DRAIN", 0, 0),
                                                                     "a-1": UP}}), {"a"})
    assert [d.message for d in read.drift] == ["lb-1's live HAProxy configuration has server(s) the plan does "
                                               "not: a-0"]
    (drift,) = instance_view("a", 0, True, [read])[1]
    assert drift.kind == "balancer" and drift.fix == DEPLOY_BALANCERS


def test_a_balancer_report_counts_only_planned_servers_in_rotation() -> None:
    report = BalancerReport(lb(), servers={"a-0": UP, "a-1": ServerStat("DRAIN", 0, 0), "x-0": UP})
    assert report.up == 1 and report.to_json()["planned"] == 2
