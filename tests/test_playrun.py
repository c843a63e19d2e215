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
    assert not any("✓" in line or "step " in line or "per-instance timings" in line for line in quiet)
    assert any(line.startswith("    restart: ernie-vllm-0.service") for line in quiet)  # a change is news
    detailed = text("-v")
    assert len(detailed) > 2 * len(quiet)
    assert any("✓" in line for line in detailed) and any("per-instance timings" in line for line in detailed)
    assert any(line.startswith("    step ") for line in detailed)
    capsys.readouterr()
    assert main(["run", str(book), "-i", str(inv), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ernie-deploy/run/v1" and doc["tasks"][2]["hosts"][0]["checks"]
