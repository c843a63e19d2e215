"""SLO gates against scripted hosts: `verify --bench` (a missed SLO is a failed check, exit 2, the bench in the
JSON), the rollout's canary gate (a miss rolls the canary back and stops the rollout; a pass lets it go on;
--no-slo-gate and check mode), and the playbook's bench task (pass, fail, gate: false, bad keys at FILE:LINE).
The fake host's bench answers with a real vllm bench serve result: TTFT p99 84.8 ms, 403.5 output tok/s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.cli import rollout as cli_rollout
from ernie_deploy.cli.main import build_parser, main
from ernie_deploy.errors import ConfigError, ExitCode
from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.bench import SloGate
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.playrun import PlaybookRunner, RunOptions, TaskRun
from ernie_deploy.orchestration.restart import Restarter, RestartOptions
from ernie_deploy.orchestration.results import HostResult, Status, exit_code
from ernie_deploy.orchestration.rollout import RolloutOptions
from ernie_deploy.orchestration.transport import Progress
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.playbook.schema import Play, Task, load_playbook
from ernie_deploy.remote.command import Op

MET = {"vllm_slo_ttft_p99_ms": 3500, "vllm_slo_min_output_throughput": 100}  # the fake's result meets these
MISSED = {"vllm_slo_ttft_p99_ms": 50}  # its TTFT p99 is 84.8 ms
UNIT = "/etc/systemd/system/ernie-vllm-0.service"


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # where raw bench results are saved
    return tmp_path / "state" / "ernie-deploy" / "bench"


def inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]], **common: Any) -> Path:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_stable_seconds": 0, **common}, "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def hosts_of(path: Path) -> list[Host]:
    return list(load_inventory(path).select(None))


def deploy(fakes: dict[str, FakeHost], path: Path, gate: SloGate | None = None, check: bool = False,
           **rollout: Any) -> tuple[Runner, list[HostResult]]:
    cycle = CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01, slo_gate=gate)
    opts = Options(check=check, cycle=cycle, rollout=RolloutOptions(slo_gate=gate, **rollout), health_timeout=5.0,
                   stable=0.0, poll=0.01)
    runner = Runner(PlanContext.load(), connector(fakes), opts)
    return runner, runner.run(hosts_of(path))


def benched(fake: FakeHost) -> list[str]:
    return [c.intent.unit for c in fake.received if c.op is Op.BENCH]  # type: ignore[attr-defined]


# -- verify --bench --------------------------------------------------------------------------------------------

def _verify(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake: FakeHost, path: Path,
            *args: str) -> tuple[int, Any]:
    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connector({"a": fake}))
    code = main(["verify", "-i", str(path), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_verify_bench_adds_the_bench_and_each_slo_as_checks_and_carries_the_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], state: Path) -> None:
    path = inventory(tmp_path, {"a": {}}, **MET)
    fake = FakeHost()
    deploy({"a": fake}, path)
    code, doc = _verify(monkeypatch, capsys, fake, path, "--bench")
    assert code == ExitCode.OK and doc["schema"] == "ernie-deploy/verify/v2"
    (host,) = doc["hosts"]
    checks = {c["name"]: c for c in host["checks"]}
    assert checks["bench"]["status"] == "pass" and "TTFT p99 84.8 ms" in checks["bench"]["summary"]
    assert checks["slo:ttft_p99_ms"]["status"] == "pass" and checks["slo:requests"]["status"] == "pass"
    (inst,) = host["bench"]
    assert inst["status"] == "ok" and inst["result"]["completed"] == 20
    assert inst["verdicts"][0]["measured"] == pytest.approx(84.83, abs=0.01)
    assert Path(inst["saved"]).parent == state / "a"
    assert benched(fake) == ["ernie-vllm-0.service"]


def test_verify_bench_exits_2_when_an_slo_is_missed_with_the_verdict_in_the_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = inventory(tmp_path, {"a": {}}, **MISSED)
    fake = FakeHost()
    deploy({"a": fake}, path)
    code, doc = _verify(monkeypatch, capsys, fake, path, "--bench")
    (host,) = doc["hosts"]
    assert code == ExitCode.FAILED and host["status"] == "failed" and host["message"].startswith("1 of ")
    (failed,) = [c for c in host["checks"] if c["status"] == "fail"]
    assert failed["name"] == "slo:ttft_p99_ms" and failed["summary"] == "TTFT p99 84.8 ms > 50 ms"
    assert "vllm_slo_ttft_p99_ms" in failed["fix"]
    (inst,) = host["bench"]
    assert inst["status"] == "slo-failed" and [v["ok"] for v in inst["verdicts"]] == [False, True]


def test_verify_bench_without_slos_reports_numbers_and_judges_nothing_and_without_bench_sends_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = inventory(tmp_path, {"a": {}})
    fake = FakeHost()
    deploy({"a": fake}, path)
    code, doc = _verify(monkeypatch, capsys, fake, path, "--bench")
    (host,) = doc["hosts"]
    assert code == ExitCode.OK and not [c for c in host["checks"] if c["name"].startswith("slo:")]
    assert host["bench"][0]["verdicts"] == [] and host["bench"][0]["result"]["output_throughput"] > 400
    code, doc = _verify(monkeypatch, capsys, fake, path)
    assert code == ExitCode.OK and doc["hosts"][0]["bench"] is None and len(benched(fake)) == 1
    help_text = _help(capsys, "verify")
    assert "Without SLOs set it still benches and reports the numbers" in help_text


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_verify_bench_leaves_an_instance_whose_checks_failed_unbenched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = inventory(tmp_path, {"a": {}}, **MET)
    fake = FakeHost()
    deploy({"a": fake}, path)
    fake.active.clear()
    code, doc = _verify(monkeypatch, capsys, fake, path, "--bench")
    (host,) = doc["hosts"]
    assert code == ExitCode.FAILED and host["bench"] == [] and not benched(fake)
    assert "ernie-vllm-0: not benched: its checks failed" in host["evidence"]


# -- the rollout's canary gate ---------------------------------------------------------------------------------

def _three(tmp_path: Path, **slo: Any) -> tuple[dict[str, FakeHost], Path, dict[str, dict[str, str]]]:
    """Three hosts deployed, then a change (max_model_len) with `slo` set on all of them."""
    fakes = {h: FakeHost() for h in "abc"}
    deploy(fakes, inventory(tmp_path, {h: {} for h in "abc"}))
    before = {h: dict(f.files) for h, f in fakes.items()}
    for fake in fakes.values():
        fake.log.clear()
        fake.received.clear()
    return fakes, inventory(tmp_path, {h: {"vllm_max_model_len": 2048} for h in "abc"}, **slo), before


def test_a_canary_that_misses_its_slos_is_rolled_back_and_the_rollout_stops(tmp_path: Path) -> None:
    fakes, path, before = _three(tmp_path, **MISSED)
    gate = SloGate()
    runner, results = deploy(fakes, path, gate, rolling=True, canary=1, resume_key="k")
    a, b, c = results
    assert a.status is Status.FAILED and a.message.startswith("SLO gate: ernie-vllm-0 slo-failed"), a.message
    assert "TTFT p99 84.8 ms > 50 ms" in a.message and a.hint and "--no-slo-gate" in a.hint
    assert "SLO gate, ernie-vllm-0: TTFT p99 84.8 ms > 50 ms" in a.evidence
    assert [ch.status for ch in a.checks if ch.name == "slo:ttft_p99_ms"] == ["fail"]
    # The canary's instance got its previous release back, restarted and re-verified (without a bench).
    assert fakes["a"].files == before["a"] and "ernie-vllm-0.service" in fakes["a"].active
    (line,) = a.change.rollbacks
    assert "rolled back to release" in line and "ready and verified" in line
    assert fakes["a"].log[-3:] == ["start ernie-vllm-0.service", "undo ernie-vllm-0.service",
                                   "start ernie-vllm-0.service"]
    assert benched(fakes["a"]) == ["ernie-vllm-0.service"]
    assert [b.status, c.status] == [Status.SKIPPED, Status.SKIPPED] and fakes["b"].log == fakes["c"].log == []
    assert runner.report.stopped == "the rollout stopped after the first batch (canary): 1 of 1 host(s) failed"
    assert runner.report.gate.startswith("SLO gate: batch 1 (a) is benched after its checks")
    assert exit_code(results) == ExitCode.FAILED


def test_a_canary_that_meets_its_slos_lets_the_rollout_go_on_and_only_the_canary_is_benched(tmp_path: Path) -> None:
    fakes, path, _ = _three(tmp_path, **MET)
    runner, results = deploy(fakes, path, SloGate(), rolling=True, canary=1, resume_key="k")
    assert [r.status for r in results] == [Status.CHANGED] * 3, [r.message for r in results]
    assert runner.report.batches == [["a"], ["b"], ["c"]] and runner.report.done == [0, 1, 2]
    assert [benched(fakes[h]) for h in "abc"] == [["ernie-vllm-0.service"], [], []]
    assert {ch.name for ch in results[0].checks} >= {"bench", "slo:ttft_p99_ms", "slo:min_output_throughput"}
    assert any(line.startswith("SLO gate (batch 1)") and "vllm_slo_ttft_p99_ms 3500" in line
               for line in results[0].evidence)
    assert "2048" in fakes["a"].files[UNIT]


def test_no_slo_gate_skips_the_bench_and_says_so(tmp_path: Path) -> None:
    fakes, path, _ = _three(tmp_path, **MISSED)
    args = build_parser().parse_args(["deploy", "-i", str(path), "--canary", "1", "--no-slo-gate"])
    gate = cli_rollout.slo_gate(args)
    assert not gate.enabled and cli_rollout.rollout_options(args, "deploy", preflight=False, gate=gate).slo_gate is gate
    runner, results = deploy(fakes, path, gate, rolling=True, canary=1, resume_key="k")
    assert [r.status for r in results] == [Status.CHANGED] * 3
    assert not any(benched(f) for f in fakes.values())
    assert runner.report.gate == "SLO gate off: batch 1 (a) has SLOs and is not benched"


def test_check_mode_says_the_gate_would_run_and_benches_nothing(tmp_path: Path) -> None:
    fakes, path, _ = _three(tmp_path, **MISSED)
    runner, results = deploy(fakes, path, SloGate(), check=True, rolling=True, canary=1)
    assert runner.report.gate.startswith("SLO gate: batch 1 (a) is benched")
    assert any("SLO gate (batch 1)" in line for line in results[0].evidence)
    assert not any("SLO gate" in line for r in results[1:] for line in r.evidence)
    assert not any(benched(f) for f in fakes.values()) and fakes["a"].log == []


def test_hosts_without_slos_are_not_gated(tmp_path: Path) -> None:
    fakes, path, _ = _three(tmp_path)
    runner, results = deploy(fakes, path, SloGate(), rolling=True, canary=1, resume_key="k")
    assert [r.status for r in results] == [Status.CHANGED] * 3 and runner.report.gate == ""
    assert not any(benched(f) for f in fakes.values())


def test_a_workload_the_canary_cannot_take_fails_it_before_anything_stops(tmp_path: Path) -> None:
    fakes, path, before = _three(tmp_path, **MET, vllm_bench_input_len=2000)
    _, results = deploy(fakes, path, SloGate(), rolling=True, canary=1, resume_key="k")
    a = results[0]
    assert a.status is Status.FAILED and "above its max_model_len 2048" in a.message
    assert "--no-slo-gate" in (a.hint or "")
    assert "stop ernie-vllm-0.service" not in fakes["a"].log and fakes["a"].files == before["a"]
    assert results[1].status is Status.SKIPPED and not benched(fakes["a"])


def test_a_restart_whose_canary_misses_its_slos_stops_the_rollout(tmp_path: Path) -> None:
    path = inventory(tmp_path, {h: {} for h in "ab"}, **MISSED)
    fakes = {h: FakeHost() for h in "ab"}
    deploy(fakes, path)
    gate = SloGate()
    opts = RestartOptions(cycle=CycleOptions(command="restart", health_timeout=5.0, stable=0.0, idle_timeout=2.0,
                                             gpu_timeout=0.3, poll=0.01, slo_gate=gate),
                          rollout=RolloutOptions(serial=[1], preflight=True, resume_key="k", slo_gate=gate))
    restarter = Restarter(PlanContext.load(), connector(fakes), opts)
    a, b = restarter.run(hosts_of(path))
    assert a.status is Status.FAILED and "SLO gate" in a.message and "kept as it is" in (a.hint or "")
    assert b.status is Status.SKIPPED and "stopped after the first batch" in restarter.report.stopped


# -- the playbook's bench task ---------------------------------------------------------------------------------

@contextmanager
def _start(play: Play, task: Task, hosts: object) -> Iterator[Progress]:
    yield lambda host, what: None


def _play(tmp_path: Path, fake: FakeHost, task: str, **slo: Any) -> list[TaskRun]:
    path = inventory(tmp_path, {"a": {}}, **slo)
    deploy({"a": fake}, path)
    book = tmp_path / "book.yml"
    book.write_text(f"- hosts: all\n  tasks:\n    - bench: {task}\n")
    runner = PlaybookRunner(load_inventory(path), PlanContext.load(), connector({"a": fake}),
                            RunOptions(base_dir=tmp_path), _start)
    return runner.run(load_playbook(book))


def test_a_bench_task_passes_with_its_workload_and_reports_the_numbers(tmp_path: Path) -> None:
    fake = FakeHost()
    (record,) = _play(tmp_path, fake, "{workload: {num_prompts: 20}, slo: {ttft_p99_ms: 3500}}")
    (r,) = record.results
    assert r.status is Status.OK, r.message
    assert any(line.startswith("ernie-vllm-0: ok: 20 request(s) ok, TTFT p99 84.8 ms") for line in r.evidence)
    (sent,) = [c for c in fake.received if c.op is Op.BENCH]
    argv = list(sent.intent.argv)  # type: ignore[attr-defined]
    assert argv[argv.index("--num-prompts") + 1] == "20" and "ttft:3500" in argv


def test_a_bench_task_fails_on_a_missed_slo_unless_gate_is_false(tmp_path: Path) -> None:
    (record,) = _play(tmp_path, FakeHost(), "{}", **MISSED)
    (r,) = record.results
    assert r.status is Status.FAILED and [c.status for c in r.checks if c.name == "slo:ttft_p99_ms"] == ["fail"]
    (record,) = _play(tmp_path, FakeHost(), "{gate: false}", **MISSED)
    (r,) = record.results
    assert r.status is Status.OK and r.message.endswith("1 missed an SLO (gate: false: reported only)")
    assert [c.status for c in r.checks if c.name == "slo:ttft_p99_ms"] == ["warn"]


def test_a_bench_task_with_gate_false_still_fails_a_down_instance(tmp_path: Path) -> None:
    fake = FakeHost()
    path = inventory(tmp_path, {"a": {}}, **MISSED)
    deploy({"a": fake}, path)
    fake.active.clear()
    book = tmp_path / "book.yml"
    book.write_text("- hosts: all\n  tasks:\n    - bench: {gate: false}\n")
    runner = PlaybookRunner(load_inventory(path), PlanContext.load(), connector({"a": fake}),
                            RunOptions(base_dir=tmp_path), _start)
    ((r,),) = [t.results for t in runner.run(load_playbook(book))]
    assert r.status is Status.FAILED and "down" in r.message


@pytest.mark.parametrize(("task", "where", "said"), [
    ("{workload: {num_prompt: 5}}", "plays[0].tasks[0].bench.workload.num_prompt",
     "unknown workload key"),
    ("{slo: {ttft_p95_ms: 5}}", "plays[0].tasks[0].bench.slo.ttft_p95_ms", "unknown slo key"),
    ("{workload: {num_prompts: 0}}", "plays[0].tasks[0].bench.workload.num_prompts", "must be"),
    ("{workload: [num_prompts]}", "plays[0].tasks[0].bench.workload", "expected dict"),
])
def test_a_bad_bench_task_is_refused_at_its_file_and_line(tmp_path: Path, task: str, where: str, said: str) -> None:
    book = tmp_path / "book.yml"
    book.write_text(f"- hosts: all\n  tasks:\n    - name: measure\n      bench: {task}\n")
    with pytest.raises(ConfigError) as err:
        load_playbook(book)
    text = str(err.value)
    assert f"{book}:4" in text and where in text and said in text, text
    if "num_prompt:" in task:
        assert "did you mean 'num_prompts'?" in (err.value.hint or "")


def test_a_rolling_task_gates_its_canary_unless_slo_gate_is_false(tmp_path: Path) -> None:
    fakes = {h: FakeHost() for h in "ab"}
    path = inventory(tmp_path, {h: {} for h in "ab"})
    deploy(fakes, path)
    path = inventory(tmp_path, {h: {"vllm_max_model_len": 2048} for h in "ab"}, **MISSED)
    book = tmp_path / "book.yml"
    for flag, statuses in (("false", [Status.CHANGED, Status.CHANGED]), ("true", [Status.FAILED, Status.SKIPPED])):
        if flag == "true":  # back to the first release, so the task has a change to roll out again
            deploy(fakes, inventory(tmp_path, {h: {} for h in "ab"}))
            path = inventory(tmp_path, {h: {"vllm_max_model_len": 2048} for h in "ab"}, **MISSED)
        task = f"rolling: {{startup_budget: 5, slo_gate: {flag}}}"
        book.write_text(f"- hosts: all\n  canary: 1\n  tasks:\n    - {task}\n")
        runner = PlaybookRunner(load_inventory(path), PlanContext.load(), connector(fakes),
                                RunOptions(base_dir=tmp_path), _start)
        (record,) = runner.run(load_playbook(book))
        assert [r.status for r in record.results] == statuses, [r.message for r in record.results]
        assert record.report is not None and ("SLO gate off" in record.report.gate) == (flag == "false")
