"""`verify`'s progress check against a scripted host: a stalled or unreadable instance fails its `progress` check
with the readings, cause and fix (exit 2); an idle one passes on a single reading; one that does not serve is not
read; check mode says what it would judge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.verify import would_check
from ernie_deploy.planning.plan import PlanContext, plan_hosts


def page(running: float, waiting: float, generated: float) -> str:
    labels = 'engine="0",model_name="ernie-4.5"'
    return (f"vllm:num_requests_running{{{labels}}} {running}\nvllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"vllm:generation_tokens_total{{{labels}}} {generated}\n")


@pytest.fixture
def deployed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeHost, Path]:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_instances": 2, "vllm_tensor_parallel_size": 1,
                             "vllm_stable_seconds": 0}, "hosts": {"a": {}}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    fake = FakeHost()
    opts = Options(health_timeout=5.0, stable=0.0, poll=0.01,
                   cycle=CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01))
    (r,) = Runner(PlanContext.load(), connector({"a": fake}), opts).run(list(load_inventory(path).select(None)))
    assert r.status is Status.CHANGED, r.message
    return fake, path


def _verify(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake: FakeHost, path: Path,
            *args: str) -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connector({"a": fake}))
    capsys.readouterr()
    code = main(["verify", "-i", str(path), "--json", *args])
    (host,) = json.loads(capsys.readouterr().out)["hosts"]
    return code, host


def _progress(host: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["instance"]: c for c in host["checks"] if c["name"] == "progress"}


def test_a_stalled_instance_fails_its_progress_check_and_verify_exits_2(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = deployed
    fake.progress_pages = {"ernie-vllm-0": [page(4, 1, 800), page(4, 2, 800)]}
    code, host = _verify(monkeypatch, capsys, fake, path)
    assert code == ExitCode.FAILED and host["status"] == "failed"
    checks = _progress(host)
    stalled = checks["ernie-vllm-0"]
    assert stalled["status"] == "fail"
    assert stalled["summary"] == ("ernie-vllm-0 is stalled: running 4→4, waiting 1→2, generated 800→800 tokens over "
                                  "5 s: requests are running but fewer than 1 tokens came out (the engine is hung "
                                  "while /health may still answer 200)")
    assert "vllm issue #39863" in stalled["cause"]
    assert "ernie-deploy restart -i INV -l a --instance 0" in stalled["fix"]
    assert checks["ernie-vllm-1"]["status"] == "pass" and "is idle" in checks["ernie-vllm-1"]["summary"]
    # Every other check passed: /health answered 200 all along, only progress tells; the smoke completion is
    # not sent to the hung engine (it would wait out its 60 s timeout) and fails naming why.
    assert [c["name"] for c in host["checks"] if c["status"] == "fail"] == ["http_completion", "progress"]
    (completion,) = [c for c in host["checks"] if c["name"] == "http_completion" and c["status"] == "fail"]
    assert completion["instance"] == "ernie-vllm-0" and completion["summary"].startswith(
        "smoke completion not sent: the engine is stalled")
    assert fake.progress_reads == [("ernie-vllm-0", 1), ("ernie-vllm-1", 1), ("ernie-vllm-0", 2)]


def test_an_unreadable_metrics_page_fails_never_healthy(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = deployed
    fake.progress_pages = {"ernie-vllm-1": ["vllm:num_requests_running 0\n"]}
    code, host = _verify(monkeypatch, capsys, fake, path)
    unread = _progress(host)["ernie-vllm-1"]
    assert code == ExitCode.FAILED and unread["status"] == "fail"
    assert "is unreadable" in unread["summary"] and "lacks vllm:num_requests_waiting" in unread["summary"]
    assert "ernie-deploy logs -i INV a --instance 1" in unread["fix"]


def test_an_idle_fleet_passes_on_a_single_reading(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = deployed
    code, host = _verify(monkeypatch, capsys, fake, path)
    assert code == ExitCode.OK, host
    assert {u: c["status"] for u, c in _progress(host).items()} == {"ernie-vllm-0": "pass", "ernie-vllm-1": "pass"}
    assert fake.progress_reads == [("ernie-vllm-0", 1), ("ernie-vllm-1", 1)]


def test_an_instance_that_does_not_serve_is_not_read(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, path = deployed
    del fake.active["ernie-vllm-1.service"]
    code, host = _verify(monkeypatch, capsys, fake, path)
    assert code == ExitCode.FAILED and set(_progress(host)) == {"ernie-vllm-0"}
    assert "ernie-vllm-1: progress not read: it does not serve (its checks say why)" in host["evidence"]
    assert fake.progress_reads == [("ernie-vllm-0", 1)]


def test_check_mode_says_it_would_judge_progress_with_the_window(deployed: tuple[FakeHost, Path]) -> None:
    _, path = deployed
    (plan,) = plan_hosts(list(load_inventory(path).select(None)), PlanContext.load())
    said = would_check(plan, Expectations())
    assert ("ernie-vllm-0: progress: /metrics readable; with requests running, tokens come out within 5s; a "
            "waiting queue does not grow while nothing runs") in said
    assert not any("progress" in line for line in would_check(plan, Expectations(), kinds=("gpus",)))


def test_verifys_one_line_names_each_instances_verified_tensor_parallel_size(
        deployed: tuple[FakeHost, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What operators run verify for, without -v (issue 38): the TP each instance runs with, as vLLM's own start-up
    lines state it."""
    fake, path = deployed
    code, host = _verify(monkeypatch, capsys, fake, path)
    tp = {c["instance"]: c["status"] for c in host["checks"] if c["name"] == "tensor_parallel"}
    assert code == 0 and tp == {"ernie-vllm-0": "pass", "ernie-vllm-1": "pass"}, host["message"]
    assert host["message"].endswith("; TP ernie-vllm-0 1 ✓, ernie-vllm-1 1 ✓"), host["message"]
    main(["verify", "-i", str(path)])
    assert "TP ernie-vllm-0 1 ✓, ernie-vllm-1 1 ✓" in capsys.readouterr().out
