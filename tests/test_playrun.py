"""Playbook runs against scripted hosts: converge stages and rolling restarts only what changed; a failed host
is left out of later tasks; any_errors_fatal and max_fail_percentage end the run; a restart that fails after a
converge goes back to what really ran before, not to the files converge just staged."""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.playrun import PlaybookRunner, RunOptions, TaskRun
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.transport import Progress
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.playbook.schema import Play, Task, load_playbook
from ernie_deploy.remote.command import Command
from ernie_deploy.remote.shelltask import OperatorCommand
from ernie_deploy.remote.ssh import RunResult

QUICK = "startup_budget: 5"


@contextmanager
def _start(play: Play, task: Task, hosts: object) -> Iterator[Progress]:
    yield lambda host, what: None


def run(tmp_path: Path, fakes: dict[str, FakeHost], book: str, extra: dict[str, object] | None = None) -> \
        tuple[PlaybookRunner, list[TaskRun]]:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_stable_seconds": 0, **(extra or {})},
                    "hosts": {name: {} for name in fakes}}}
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(data))
    path = tmp_path / "book.yml"
    path.write_text(book)
    runner = PlaybookRunner(load_inventory(inv), PlanContext.load(), connector(fakes),
                            RunOptions(base_dir=tmp_path), _start)
    return runner, runner.run(load_playbook(path))


SITE = f"""
- hosts: all
  tasks:
    - converge: {{}}
    - rolling: {{{QUICK}}}
    - verify: {{}}
"""


def statuses(records: list[TaskRun]) -> list[dict[str, str]]:
    return [{r.host: r.status.value for r in rec.results} for rec in records]


def test_converge_stages_and_rolling_restarts_only_what_changed(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost()}
    _, records = run(tmp_path, fakes, SITE)
    assert statuses(records) == [{"a": "changed", "b": "changed"}] * 2 + [{"a": "ok", "b": "ok"}]
    assert fakes["a"].log == ["start ernie-vllm-0.service"]
    _, records = run(tmp_path, fakes, SITE)
    assert statuses(records) == [{"a": "ok", "b": "ok"}] * 3
    assert fakes["a"].log == ["start ernie-vllm-0.service"]  # nothing restarted the second time


def test_a_failed_host_is_left_out_of_later_tasks(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost(fail_start="--tensor-parallel-size")}
    runner, records = run(tmp_path, fakes, SITE)
    assert statuses(records)[1] == {"a": "changed", "b": "failed"}
    assert [r.host for r in records[2].results] == ["a"]
    assert runner.ended is None


def test_any_errors_fatal_ends_the_run(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost(fail_start="--tensor-parallel-size")}
    runner, records = run(tmp_path, fakes, "- hosts: all\n  any_errors_fatal: true\n" + SITE.split("\n", 2)[2])
    assert [rec.task.action for rec in records] == ["converge", "rolling"]
    assert runner.ended is not None and "any_errors_fatal" in runner.ended


def test_max_fail_percentage_ends_the_run(tmp_path: Path) -> None:
    fakes = {"a": FakeHost(unreachable=True), "b": FakeHost()}
    runner, records = run(tmp_path, fakes, "- hosts: all\n  max_fail_percentage: 40\n" + SITE.split("\n", 2)[2])
    assert [rec.task.action for rec in records] == ["converge"]
    assert records[0].results[0].status is Status.UNREACHABLE
    assert runner.ended is not None and "more than max_fail_percentage 40%" in runner.ended


def test_a_failed_restart_after_converge_goes_back_to_what_ran(tmp_path: Path) -> None:
    fakes = {"a": FakeHost()}
    run(tmp_path, fakes, SITE)
    ran = dict(fakes["a"].files)
    # A new setting is staged by converge; its restart then fails, so the unit gets the first release back.
    fakes["a"].fail_start = "--max-model-len 2048"
    _, records = run(tmp_path, fakes, SITE, {"vllm_max_model_len": 2048})
    assert statuses(records)[:2] == [{"a": "changed"}, {"a": "failed"}]
    assert fakes["a"].files == ran
    assert "ernie-vllm-0.service" not in fakes["a"].pending


class CommandHost:
    """A host that runs whatever it is sent and keeps it: the command task's one command."""

    def __init__(self) -> None:
        self.sent: list[Command] = []
        self.commands = 0
        self.history: list[str] = []

    def run(self, cmd: Command) -> RunResult:
        self.sent.append(cmd)
        self.commands += 1
        self.history.append(cmd.label)
        return RunResult(cmd.label, 0, b"done\n", b"")

    def close(self) -> None:
        pass


def test_the_command_task_audits_who_ran_it_like_every_change(tmp_path: Path) -> None:
    host = CommandHost()
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"a": {"ansible_host": "127.0.0.1"}}}}))
    book = tmp_path / "book.yml"
    book.write_text("- hosts: all\n  tasks:\n    - name: clean\n      command: {run: 'rm -rf /tmp/x'}\n")
    runner = PlaybookRunner(load_inventory(inv), PlanContext.load(), lambda target: host,
                            RunOptions(base_dir=tmp_path), _start)
    (record,) = runner.run(load_playbook(book))
    assert [r.status for r in record.results] == [Status.CHANGED]
    (cmd,) = host.sent
    assert isinstance(cmd.intent, OperatorCommand)
    assert cmd.intent.audit["user"] == getpass.getuser()
    assert cmd.intent.audit["controller"] == socket.gethostname()
    assert cmd.intent.audit["command"] == "ernie-deploy run (clean)" and cmd.intent.audit["run"] == "rm -rf /tmp/x"


def test_check_mode_on_fresh_hosts_says_what_verify_would_check(tmp_path: Path) -> None:
    """Check mode starts nothing, so verify must not judge services it never started: it names, per instance,
    the checks it would run, and the run passes (issue 23, item 8)."""
    fakes = {"a": FakeHost(), "b": FakeHost()}
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2,
                                                     "ansible_host": "127.0.0.1", "vllm_host": "127.0.0.1"},
                                            "hosts": {"a": {}, "b": {}}}}))
    path = tmp_path / "book.yml"
    path.write_text(SITE + "    - gpu_check: {}\n")
    runner = PlaybookRunner(load_inventory(inv), PlanContext.load(), connector(fakes),
                            RunOptions(base_dir=tmp_path, check=True), _start)
    records = runner.run(load_playbook(path))
    assert [h.log for h in fakes.values()] == [[], []]  # nothing started
    verify, gpu = records[2], records[3]
    assert {r.status for rec in records for r in rec.results} == {Status.CHANGED, Status.OK}
    for rec in (verify, gpu):
        assert {r.status for r in rec.results} == {Status.OK}
        assert [r.host for r in rec.results] == ["a", "b"]
        r = rec.results[0]
        assert r.checks == [] and "would run" in r.message
        assert [s.status.value for s in r.steps if s.name == "checks"] == ["would check"]
    lines = "\n".join(verify.results[0].evidence)
    assert "ernie-vllm-0" in lines and "/health" in lines and "/v1/models" in lines
    assert "systemd" in lines and "start-up log" in lines and "GPU" in lines
    gpu_lines = "\n".join(gpu.results[0].evidence)
    assert "GPU" in gpu_lines and "/health" not in gpu_lines


def test_hooks_under_run_get_the_documented_command_names(tmp_path: Path) -> None:
    """ERNIE_COMMAND is `deploy` for a rolling task, `restart` with `always: true` (docs/hooks.md) and `run` for a
    playbook's hook task; the audit log keeps the playbook's label (issue 23, item 13)."""
    seen = tmp_path / "seen.txt"
    hook = f"echo \"$ERNIE_HOOK $ERNIE_COMMAND\" >> {seen}"
    fakes = {"a": FakeHost()}
    run(tmp_path, fakes, f"""
- hosts: all
  tasks:
    - converge: {{}}
    - rolling: {{{QUICK}, post_ready: '{hook}'}}
    - restart: {{{QUICK}, always: true, pre_drain: '{hook}'}}
    - hook: {{run: '{hook}'}}
""")
    assert seen.read_text().splitlines() == ["post-ready deploy", "pre-drain restart", "hook run"]


def test_run_prints_a_line_per_host_and_task_and_details_with_v(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The Output rule (issue 23): by default a line per host and task, the changes and problems; passing
    checks, steps and timings with -v; --json unchanged."""
    import ernie_deploy.cli.run as cli_run
    from ernie_deploy.cli.main import main
    fakes = {"a": FakeHost(), "b": FakeHost()}
    monkeypatch.setattr(cli_run, "connector", lambda args: connector(fakes))
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2,
                                                     "ansible_host": "127.0.0.1", "vllm_host": "127.0.0.1",
                                                     "vllm_stable_seconds": 0, "vllm_gpu_memory_utilization": 0.99},
                                            "hosts": {"a": {}, "b": {}}}}))
    book = tmp_path / "site.yml"
    book.write_text(SITE.replace("verify: {}", f"verify: {{}}\n    - rolling: {{{QUICK}, always: true}}"))

    def text(*extra: str) -> list[str]:
        capsys.readouterr()
        assert main(["run", str(book), "-i", str(inv), *extra]) == 0
        return capsys.readouterr().out.splitlines()

    quiet = text()
    assert sum(line.startswith(("ok: ", "changed: ")) for line in quiet) == 8  # 4 tasks x 2 hosts
    # Passing checks are -v's; verify's own line names the TP each instance was verified to run with.
    assert not any(("✓" in line and "; TP " not in line) or "step " in line or "per-instance timings" in line
                   for line in quiet)
    assert any(line.startswith("    restart: ernie-vllm-0.service") for line in quiet)  # a change is news
    detailed = text("-v")
    assert len(detailed) > 2 * len(quiet)
    assert any("✓" in line for line in detailed) and any("per-instance timings" in line for line in detailed)
    assert any(line.startswith("    step ") for line in detailed)
    capsys.readouterr()
    assert main(["run", str(book), "-i", str(inv), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ernie-deploy/run/v1" and doc["tasks"][2]["hosts"][0]["checks"]


# -- the inventory's balancers (issue 24) ------------------------------------------------------------------------

def balanced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, balancer: FakeHost) -> tuple[
        dict[str, FakeHost], list[str]]:
    """vLLM hosts a and b and lb-1 (HAProxy, fronting both) in tmp_path/inv.yml, reached through one scripted
    SSH door that journals which host each command went to, in order."""
    fakes = {"a": FakeHost(), "b": FakeHost(), "lb-1": balancer}
    journal: list[str] = []
    door = connector(fakes)

    def connect(target: Any) -> Any:
        session = door(target)
        sent = session.run

        def run(cmd: Command) -> RunResult:
            journal.append(target.name)
            result: RunResult = sent(cmd)
            return result

        session.run = run
        return session

    monkeypatch.setattr("ernie_deploy.cli.run.connector", lambda args: connect)
    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connect)
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {
        "vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "vllm_host": "0.0.0.0", "vllm_stable_seconds": 0},
        "hosts": {"a": {"ansible_host": "127.0.0.11"}, "b": {"ansible_host": "127.0.0.12"}},
        "children": {"vllm_balancers": {"hosts": {"lb-1": {"ansible_host": "127.0.0.9"}}}}}}))
    return fakes, journal


def play(tmp_path: Path, text: str, *args: str, name: str = "book.yml") -> int:
    """`ernie-deploy run --json` of the playbook `text` (written to tmp_path/name) on balanced()'s inventory."""
    from ernie_deploy.cli.main import main

    path = tmp_path / name
    path.write_text(text)
    return main(["run", str(path), "-i", str(tmp_path / "inv.yml"), "--json", *args])


def doc(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def tasks(document: dict[str, Any]) -> list[list[tuple[str, str]]]:
    return [[(h["host"], h["status"]) for h in t["hosts"]] for t in document["tasks"]]


RESTART = f"""
- hosts: all
  serial: 1
  tasks:
    - rolling: {{{QUICK}, always: true}}
"""


def test_a_playbook_applies_the_balancer_first_and_its_rolling_restart_drains_and_readies_each_instance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeBalancer

    haproxy = FakeBalancer(running=False)
    fakes, journal = balanced(tmp_path, monkeypatch, FakeHost(balancer=haproxy))
    code = play(tmp_path, SITE)
    site = doc(capsys)
    assert code == 0, site
    # converge applies lb-1's configuration before any command reaches a vLLM host; rolling finds it unchanged.
    assert tasks(site)[:2] == [[("lb-1", "changed"), ("a", "changed"), ("b", "changed")],
                               [("lb-1", "ok"), ("a", "changed"), ("b", "changed")]]
    assert site["tasks"][0]["hosts"][0]["message"] == "balancer: HAProxy configuration changed, started"
    first_vllm = min(journal.index("a"), journal.index("b"))
    assert set(journal[:first_vllm]) == {"lb-1"} and haproxy.log == ["started"]
    assert tasks(site)[2] == [("a", "ok"), ("b", "ok")]  # verify: vLLM hosts only
    assert sorted(s.strip('"') for _, s in haproxy.servers) == ["a-0", "b-0"]
    # A rolling restart drains each instance on lb-1 before its stop and sets it ready after its start, one host
    # after the other; the configuration is not touched (a restart changes no file).
    for fake in fakes.values():
        fake.log.clear()
    haproxy.log.clear()
    code = play(tmp_path, RESTART, name="restart.yml")
    assert code == 0 and tasks(doc(capsys)) == [[("a", "changed"), ("b", "changed")]]
    assert [x.rpartition("/")[2] for x in haproxy.log] == ["a-0 drain", "a-0 ready", "b-0 drain", "b-0 ready"]
    assert fakes["a"].log == ["stop ernie-vllm-0.service", "start ernie-vllm-0.service"]
    assert all(s.status == "UP" for s in haproxy.servers.values())
    # A second run of the site playbook changes nothing anywhere, the balancer included.
    code = play(tmp_path, SITE)
    assert code == 0 and {s for t in tasks(doc(capsys)) for _, s in t} == {"ok"}


def test_a_play_of_the_balancers_alone_applies_their_configuration_and_check_mode_applies_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeBalancer

    haproxy = FakeBalancer(running=False)
    fakes, journal = balanced(tmp_path, monkeypatch, FakeHost(balancer=haproxy))
    book = "- hosts: vllm_balancers\n  tasks:\n    - converge: {}\n    - verify: {}\n"
    code = play(tmp_path, book, "--check")
    checked = doc(capsys)
    assert code == 0 and tasks(checked) == [[("lb-1", "changed")], []]
    assert "check mode" in checked["tasks"][0]["hosts"][0]["message"]
    assert haproxy.config is None and haproxy.log == [] and set(journal) == {"lb-1"}
    code = play(tmp_path, book)
    done = doc(capsys)
    assert code == 0 and tasks(done) == [[("lb-1", "changed")], []]
    assert "only its converge and rolling tasks work on them" in done["tasks"][1]["note"]
    assert haproxy.log == ["started"] and set(journal) == {"lb-1"}
    # --limit narrows the balancers too: a play of every host limited to a applies no configuration.
    haproxy.log.clear()
    code = play(tmp_path, "- hosts: all\n  tasks:\n    - converge: {}\n", "--limit", "a")
    assert code == 0 and tasks(doc(capsys)) == [[("a", "changed")]] and haproxy.log == []
    assert fakes["b"].received == []


def test_a_configuration_haproxy_rejects_ends_the_run_with_no_vllm_host_touched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeBalancer

    haproxy = FakeBalancer(invalid="vllm")
    _, journal = balanced(tmp_path, monkeypatch, FakeHost(balancer=haproxy))
    code = play(tmp_path, SITE)
    document = doc(capsys)
    assert code == 2 and tasks(document) == [[("lb-1", "failed"), ("a", "skipped"), ("b", "skipped")]]
    assert "fails `haproxy -c`" in document["tasks"][0]["hosts"][0]["message"]
    assert "balancer lb-1 failed" in document["ended"] and "no vLLM host was touched" in document["ended"]
    assert set(journal) == {"lb-1"} and haproxy.config is None


def test_no_balancer_drives_and_applies_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeBalancer

    haproxy = FakeBalancer()
    _, journal = balanced(tmp_path, monkeypatch, FakeHost(balancer=haproxy))
    code = play(tmp_path, SITE, "--no-balancer")
    assert code == 0 and [[h for h, _ in t] for t in tasks(doc(capsys))] == [["a", "b"]] * 3
    code = play(tmp_path, RESTART, "--no-balancer", name="restart.yml")
    assert code == 0
    assert "lb-1" not in journal and haproxy.log == [] and haproxy.config is None
    # The text output says the balancers were not driven; a play of the balancers alone says why it did nothing.
    from ernie_deploy.cli.main import main

    assert main(["run", str(tmp_path / "restart.yml"), "-i", str(tmp_path / "inv.yml"), "--no-balancer"]) == 0
    assert "--no-balancer: the balancers (lb-1) were not driven" in capsys.readouterr().out
    code = play(tmp_path, "- hosts: lb-1\n  tasks:\n    - converge: {}\n", "--no-balancer", name="lb.yml")
    assert code == 0 and "leaves alone (--no-balancer)" in doc(capsys)["tasks"][0]["note"]


def test_an_unreachable_balancer_refuses_the_rolling_task_before_anything_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeBalancer

    fakes, _ = balanced(tmp_path, monkeypatch, FakeHost(balancer=FakeBalancer()))
    assert play(tmp_path, SITE) == 0
    capsys.readouterr()
    fakes["lb-1"].unreachable = True
    for fake in fakes.values():
        fake.log.clear()
    code = play(tmp_path, RESTART + "    - verify: {}\n", name="restart.yml")
    document = doc(capsys)
    assert code == 2 and tasks(document) == [[("a", "failed"), ("b", "failed")], []]
    message = document["tasks"][0]["hosts"][0]["message"]
    assert "refused to start the rollout" in message and "lb-1" in message and "connection refused" in message
    assert document["tasks"][1]["note"] == "no hosts left"
    assert fakes["a"].log == [] and fakes["b"].log == []  # nothing stopped


def test_run_help_says_when_to_use_no_balancer(capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.cli.main import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-balancer" in text and "down" in text and "requests" in text and "lost" in text


def test_a_vllm_host_that_cannot_be_planned_stops_the_run_before_any_host_unless_no_balancer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeBalancer

    _, journal = balanced(tmp_path, monkeypatch, FakeHost(balancer=FakeBalancer()))
    inv = tmp_path / "inv.yml"
    data = yaml.safe_load(inv.read_text())
    data["all"]["hosts"]["b"]["gpu_model"] = "nope"
    inv.write_text(yaml.safe_dump(data))
    assert play(tmp_path, SITE, "--limit", "a") == 5
    assert "b: the plan has errors, so the balancers" in capsys.readouterr().err and journal == []
    assert play(tmp_path, SITE, "--limit", "a", "--no-balancer") == 0
    assert "lb-1" not in journal and "a" in journal
