"""Playbook runs against scripted hosts: converge stages and rolling restarts only what changed; a failed host
is left out of later tasks; any_errors_fatal and max_fail_percentage end the run; a restart that fails after a
converge goes back to what really ran before, not to the files converge just staged."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
