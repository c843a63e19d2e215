"""The exported role's checker (export/hostscript.py, run on hosts by Ansible) against the project's own log
checks: over every log fixture, and for TP 1, 2 and 4, both must reach the same verdicts on the tensor parallel
size in use and on fatal start-up lines (the same signatures), so the checker cannot drift unnoticed."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ernie_deploy.checks.logscan import check_startup_log
from ernie_deploy.checks.signatures import scan
from ernie_deploy.export.program import host_program

# Real vLLM's captures (scripts/capture-real-vllm: bad starts, and healthy starts stopped by SIGTERM) join the
# log fixtures as they are recorded.
FIXTURES = sorted((Path(__file__).parent / "fixtures" / "logs").glob("*/*.log")) + sorted(
    (Path(__file__).parent / "fixtures" / "real-vllm").glob("*/*.log"))


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "ernie_host.py"
    path.write_text(host_program())
    return path


@pytest.fixture(scope="module")
def checker(program: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("ernie_host", program)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fixtures_cover_healthy_and_fatal_logs() -> None:
    names = [p.name for p in FIXTURES]
    assert len(names) > 30 and any("healthy" in n for n in names) and any("fault" in n for n in names)


@pytest.mark.parametrize("log", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_same_verdicts_as_the_projects_checks(checker: ModuleType, log: Path) -> None:
    lines = log.read_text(errors="replace").splitlines()
    for tp in (1, 2, 4):
        results = {r.name: r for r in check_startup_log(lines, tp=tp, max_model_len=None, kv_tokens_estimate=None)}
        status, _ = checker.tp_verdict(lines, tp)
        assert status == results["tensor_parallel"].status, (tp, results["tensor_parallel"].summary)
        fatal, matches = checker.fatal_verdict(lines)
        assert fatal == results["startup_errors"].status
        assert [m["signature"] for m in matches] == [m.signature for m in scan(lines)]


def test_the_command_line_judges_a_log_file(program: Path) -> None:
    healthy = next(p for p in FIXTURES if p.name == "healthy-0.11.0-tp1.log")
    done = subprocess.run([sys.executable, str(program), "check", "x", "--tp", "1", "--log", str(healthy)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["tensor_parallel"]["status"] == "pass"
    wrong = subprocess.run([sys.executable, str(program), "check", "x", "--tp", "2", "--log", str(healthy)],
                           capture_output=True, text=True, check=False)
    assert wrong.returncode == 1 and json.loads(wrong.stdout)["tensor_parallel"]["status"] == "fail"
    oom = next(p for p in FIXTURES if p.name == "fault-0.34.0-cuda_oom.log")
    fatal = subprocess.run([sys.executable, str(program), "check", "x", "--tp", "1", "--log", str(oom)],
                           capture_output=True, text=True, check=False)
    assert fatal.returncode == 1 and json.loads(fatal.stdout)["startup_errors"]["status"] == "fail"


def test_the_program_is_python_38_syntax(program: Path) -> None:
    """Hosts may have an old python3: the shipped program must parse as 3.8 and pass ruff with a py38 target."""
    ast.parse(program.read_text(), feature_version=(3, 8))
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--target-version", "py38",
                           "--select", "E,F,W,UP,B", "--ignore", "E501", str(program)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# --- an intended stop: the host program reads it as the project's checks do -----------------------------

STOP = next(p for p in FIXTURES if p.name == "stop-abort-0.32.log")
TRIGGER = "[shutdown] API server: shutdown triggered"
STOPPING = "Stopping ernie-vllm-0.service - vLLM serving ernie on port 8000 (ernie-deploy ernie-vllm-0)..."
WORKER_DIED = ("(EngineCore pid=2837) ERROR 12-05 10:04:43 [multiproc_executor.py:316] Worker proc VllmWorker-0 died "
               "unexpectedly (exit code: -9), shutting down executor.")  # vLLM 0.32.0 source text


def stop_variants() -> dict[str, list[str]]:
    """The real stop, told by systemd alone, with an engine death during it, and followed by a run that crashes."""
    lines = STOP.read_text(errors="replace").splitlines()
    at = next(i for i, line in enumerate(lines) if TRIGGER in line)
    dead = (Path(__file__).parent / "fixtures" / "logs" / "real" / "engine-dead.log").read_text().splitlines()
    again = next(line for line in lines if "non-default args" in line)
    return {"systemd-only": [*lines[:at], STOPPING, *lines[at + 1:]],
            "death-during-stop": [*lines[:at + 1], WORKER_DIED, *lines[at + 1:]],
            "next-run-crashes": [*lines, again, *dead[1:]]}


@pytest.mark.parametrize("variant", ["systemd-only", "death-during-stop", "next-run-crashes"])
def test_same_verdicts_on_stops(checker: ModuleType, variant: str) -> None:
    lines = stop_variants()[variant]
    expected = [m.signature for m in scan(lines)]
    assert expected == ([] if variant == "systemd-only" else ["engine_dead"])
    fatal, matches = checker.fatal_verdict(lines)
    assert [m["signature"] for m in matches] == expected
    assert fatal == ("pass" if not expected else "fail")


def test_the_command_line_reads_a_stopped_run_as_a_shutdown(program: Path) -> None:
    done = subprocess.run([sys.executable, str(program), "check", "x", "--tp", "1", "--log", str(STOP)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    errors = json.loads(done.stdout)["startup_errors"]
    assert errors["status"] == "pass" and errors["signatures"] == []
    assert f"stopped on request ({TRIGGER})" in errors["message"] and "not a crash" in errors["message"]


def test_wait_names_a_stop_not_an_engine_death(checker: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The unit is stopped while the role waits for it: the wait ends at once and says so."""
    lines = STOP.read_text(errors="replace").splitlines()
    monkeypatch.setattr(checker, "show", lambda unit, prop: {"ActiveState": "deactivating"}.get(prop, "0"))
    monkeypatch.setattr(checker, "journal", lambda unit: lines)
    args = argparse.Namespace(unit="ernie-vllm-0", url="http://127.0.0.1:8000/health", timeout=600.0, stable=10.0,
                              interval=0.0)
    assert checker.cmd_wait(args) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"ernie-vllm-0.service was stopped while waiting for it to become ready ({TRIGGER})")
    assert "engine_dead" not in out
