"""The README's exit-code table, row by row: every code listed is the one the situation really gives."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from fakehost import FakeHost, connector

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.results import exit_code
from ernie_deploy.planning.plan import PlanContext

A10 = {"gpu_model": "NVIDIA A10", "gpu_count": 1}


def readme_codes() -> dict[int, str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Exit codes"):]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", table, re.MULTILINE)}


def write(tmp: Path, **host: object) -> str:
    inv = tmp / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"h": {"ansible_host": "127.0.0.1", **A10, **host}}}}))
    return str(inv)


def ok(tmp: Path) -> int:
    return main(["plan", "-i", write(tmp)])


def plan_errors(tmp: Path) -> int:
    return main(["plan", "-i", write(tmp, gpu_count=4, vllm_tensor_parallel_size=3)])


def host_failed(tmp: Path) -> int:
    # A plan error is a failed host for deploy (found before any connection: the port is not an int).
    return main(["deploy", "-i", write(tmp, vllm_port="x")])


def unreachable(tmp: Path) -> int:
    return main(["deploy", "-i", write(tmp, ansible_port=1), "--connect-timeout", "1"])  # nothing listens


def bad_input(tmp: Path) -> int:
    inv = tmp / "inv.yml"
    inv.write_text("all: [\n")
    return main(["plan", "-i", str(inv)])


def locked(tmp: Path) -> int:
    holder = '{"command": "c", "controller": "other", "pid": 7, "since": 0, "token": "f00", "user": "u"}'
    run = Runner(PlanContext.load(), connector({"h": FakeHost(lock_info=holder)}), Options())
    return exit_code(run.run(list(load_inventory(Path(write(tmp))).select(None))), run.stopped_by)


def interrupted(tmp: Path) -> int:
    return exit_code([], signal.SIGINT)  # the run itself: tests/test_deploy_flow.py's Ctrl-C test


def terminated(tmp: Path) -> int:
    return exit_code([], signal.SIGTERM)  # the run itself: the lab's SIGTERM test


def reader_gone(tmp: Path) -> int:
    """`ernie-deploy plan | head`: the reader closed the pipe before the output came (issue 23, item 13)."""
    proc = subprocess.Popen([sys.executable, "-m", "ernie_deploy", "plan", "-i", str(ROOT / "inventory/example.yml"),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert err == "", err  # quietly: no BrokenPipeError traceback
    return proc.wait()


SCENARIOS: dict[int, Callable[[Path], int]] = {0: ok, 1: plan_errors, 2: host_failed, 4: unreachable, 5: bad_input,
                                               6: locked, 130: interrupted, 141: reader_gone, 143: terminated}


def test_every_readme_code_is_an_exit_code_with_a_scenario() -> None:
    codes = readme_codes()
    assert set(codes) == {int(c) for c in ExitCode}
    assert set(codes) == set(SCENARIOS)


@pytest.mark.parametrize("code", sorted(SCENARIOS))
def test_scenario_gives_its_code(code: int, tmp_path: Path) -> None:
    assert SCENARIOS[code](tmp_path) == code, readme_codes()[code]


def test_logs_of_an_unreachable_host_exits_as_unreachable(tmp_path: Path) -> None:
    """Commands that reach one host directly (not through a multi-host run) exit by the same table."""
    assert main(["logs", "-i", write(tmp_path, ansible_port=1), "h", "--connect-timeout", "1"]) == ExitCode.UNREACHABLE
