"""`ernie-deploy calibrate`: the candidate grid (planner-valid, bounded), the ranking, the measured row and its
merge into a table file, and the command against a scripted host whose bench answers depend on the deployed
settings: the documented winner, the release restored after success, a failed start and SIGTERM, no winner, and
bad input."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import BENCH_RESULT, FakeHost, connector

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ConfigError, ExitCode, InventoryError
from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.calibrate import Calibrator, prepare, write_table
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.fleet import FleetOptions
from ernie_deploy.orchestration.restart import RestartOptions
from ernie_deploy.orchestration.results import Status, exit_code
from ernie_deploy.planning.bench import BenchResult, BenchSpec, Workload
from ernie_deploy.planning.calibrate import Candidate, best, choose, grid, measure, merge
from ernie_deploy.planning.hardware import load_catalog
from ernie_deploy.planning.plan import PlanContext, plan_host
from ernie_deploy.planning.recommend import load_table
from ernie_deploy.remote.command import Op
from ernie_deploy.remote.releases import Restore

UNIT = "/etc/systemd/system/ernie-vllm-0.service"
FAST_CYCLE = CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01)
DEPLOY = Options(health_timeout=5.0, stable=0.0, poll=0.01, cycle=FAST_CYCLE)


def _inventory(tmp_path: Path, **host_vars: object) -> Path:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1", "vllm_stable_seconds": 0},
                    "hosts": {"a": {"vllm_slo_ttft_p99_ms": 1000, **host_vars}}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def _hosts(path: Path) -> list[Host]:
    return list(load_inventory(path).select(None))


def _deployed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **host_vars: object) -> tuple[FakeHost, Path]:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    inv = _inventory(tmp_path, **host_vars)
    fake = FakeHost()
    (r,) = Runner(PlanContext.load(), connector({"a": fake}), DEPLOY).run(_hosts(inv))
    assert r.status is Status.CHANGED, r.message
    return fake, inv


def _result(throughput: float, ttft_p99: float) -> str:
    return json.dumps({**json.loads(BENCH_RESULT), "output_throughput": throughput, "p99_ttft_ms": ttft_p99})


def _when(tp: int, length: int, seqs: int) -> str:
    return f"--tensor-parallel-size {tp} && --max-model-len {length} && --max-num-seqs {seqs}"


# The documented scenario (docs/calibrate.md): TP 1/256/256 and TP 2/256/8 both reach 500 tok/s, the first with
# the lower p99 TTFT, so it wins; TP 1/512/8 is faster but misses the 1000 ms TTFT SLO; TP 2/512/8 does not start.
SCRIPT = {_when(1, 256, 8): _result(300, 100), _when(2, 256, 8): _result(500, 200),
          _when(1, 256, 256): _result(500, 150), _when(1, 512, 8): _result(900, 5000),
          _when(2, 256, 256): _result(400, 90)}


def _calibrator(fake: FakeHost, saved: Path, progress: Any = None, bound: float = 3600.0) -> Calibrator:
    return Calibrator(PlanContext.load(), connector({"a": fake}), deploy=DEPLOY,
                      restore=RestartOptions(cycle=FAST_CYCLE), fleet_options=FleetOptions(), time_bound=bound,
                      save_dir=saved, progress=progress, now=lambda: "2026-01-02T03:04Z")


def _restored(fake: FakeHost, files: dict[str, str], release: str, rolled_back: bool = True) -> None:
    """The host has the release's files and runs its instance; `rolled_back`: by calibrate's rollback (else a
    failed start's own put-back left nothing to roll back)."""
    assert fake.files == files and "ernie-vllm-0.service" in fake.active
    restores = [c.intent for c in fake.received if isinstance(c.intent, Restore)]
    assert bool(restores) == rolled_back and (not restores or restores[-1].release == release)


# -- the pure part ---------------------------------------------------------------------------------------------

def test_the_grid_is_every_tp_first_then_longer_contexts_and_bigger_batches(tmp_path: Path) -> None:
    (host,) = _hosts(_inventory(tmp_path))
    plan = plan_host(host, PlanContext.load())
    cands = grid(plan, BenchSpec(Workload(input_len=300, output_len=100, max_concurrency=4)))
    # need 400 → 512, 1024, and the row's 4096; max_num_seqs 4 (the concurrency) and vLLM's 256 for an A10.
    assert cands[:2] == [Candidate(1, 512, 4), Candidate(2, 512, 4)]
    assert {c.max_model_len for c in cands} == {512, 1024, 4096} and {c.max_num_seqs for c in cands} == {4, 256}
    assert {c.tensor_parallel_size for c in cands} == {1, 2} and len(cands) == 12


def test_candidates_the_planner_refuses_are_skipped_with_its_reason_and_the_bound_holds(tmp_path: Path) -> None:
    (host,) = _hosts(_inventory(tmp_path, vllm_instances=2))
    ctx = PlanContext.load()
    found = choose(host, plan_host(host, ctx), BenchSpec(), ctx, 3)
    assert len(found.tried) == 3 and all(c.tensor_parallel_size == 1 for c in found.tried)
    assert found.invalid and all(s.candidate.tensor_parallel_size == 2 for s in found.invalid)
    assert found.invalid[0].reason == "TP 2 × PP 1 = 2 GPUs, but this instance has 0"  # the planner's own words
    assert len(found.over) == 6 - 3


def test_the_winner_meets_every_slo_with_the_highest_throughput_then_the_lower_ttft() -> None:
    def result(tput: float, ttft: float) -> BenchResult:
        return BenchResult(20, 0, 1.0, 10.0, tput, None, 640, {"ttft": {"p99": ttft}, "tpot": {"p99": 9.0}})

    a, b, c = Candidate(1, 256, 8), Candidate(2, 256, 8), Candidate(1, 512, 8)
    ranked = [(a, measure([result(500, 200)], True)), (b, measure([result(500, 150)], True)),
              (c, measure([result(900, 90)], False))]
    winner = best(ranked)
    assert winner is not None and winner[0] == b
    assert best([(c, measure([result(900, 90)], False))]) is None
    two = measure([result(100, 80), result(150, 120)], True)
    assert two is not None and (two.output_throughput, two.ttft_p99_ms) == (250, 120)  # summed; the worst
    assert measure([result(100, 80), None], True) is None  # an instance without a result: nothing to rank


def test_merge_replaces_the_row_of_the_class_in_place_and_keeps_shared_rows() -> None:
    catalog = load_catalog()
    table = {"rows": [{"name": "x", "gpu_model": "NVIDIA A10", "gpu_count": 1},
                      {"name": "old", "gpu_model": "NVIDIA A10", "gpu_count": 2},
                      {"name": "shared", "gpu_model": ["NVIDIA A10", "NVIDIA A100-SXM4-80GB"], "gpu_count": 2}]}
    row = {"name": "new", "gpu_model": "NVIDIA A10", "gpu_count": 2}
    merged = merge(table, row, catalog)
    assert [r["name"] for r in merged["rows"]] == ["x", "new", "shared"]
    assert [r["name"] for r in merge(merged, {**row, "name": "newer"}, catalog)["rows"]] == ["x", "newer", "shared"]


def test_a_measured_row_with_a_bad_word_is_refused_naming_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "t.yml"
    base = yaml.safe_load(Path("ernie_deploy/data/recommendations.yml").read_text())
    measured = {"host": "a\nExecStartPre=/bin/sh", "date": "2026-01-02", "vllm_version": "0.34.0",
                "workload": {}, "results": {}}
    base["rows"][0]["measured"] = measured
    path.write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match=r"rows\[0\].measured.host: expected a word") as err:
        load_table(load_catalog(), path)
    assert err.value.where == str(path)
    base["rows"][0]["measured"] = {**measured, "host": "a"}
    path.write_text(yaml.safe_dump(base).replace("'2026-01-02'", "2026-01-02"))  # YAML's date: the same day
    row = load_table(load_catalog(), path).rows[0]
    assert row.measured is not None and row.name == "1xA10, measured on a at 2026-01-02 (vLLM 0.34.0)"


# -- against a scripted host -----------------------------------------------------------------------------------

def test_calibrate_picks_the_documented_winner_restores_the_release_and_writes_a_row_plan_uses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    files, release = dict(fake.files), str(fake.releases[-1]["id"])
    fake.bench_when = SCRIPT
    fake.fail_start = "--tensor-parallel-size 2 && --max-model-len 512"
    monkeypatch.setattr("ernie_deploy.cli.calibrate.connector", lambda args: connector({"a": fake}))
    code = main(["calibrate", "-i", str(inv), "--json", "--save", str(tmp_path / "saved")])
    doc = json.loads(capsys.readouterr().out)
    host = doc["hosts"]["a"]
    assert code == ExitCode.OK, host["message"]
    assert [t["status"] for t in host["trials"]] == ["met", "met", "met", "slo-failed", "met", "failed"]
    assert host["winner"]["candidate"] == {"tensor_parallel_size": 1, "max_model_len": 256, "max_num_seqs": 256}
    assert host["restored"]["ok"] and host["release"] == release
    _restored(fake, files, release)
    table = tmp_path / "calibration.yml"
    assert doc["table_out"] == str(table)
    (row,) = [r for r in yaml.safe_load(table.read_text())["rows"] if "measured" in r]
    assert (row["tensor_parallel_size"], row["max_model_len"], row["extra_args"]) == (1, 256, ["--max-num-seqs",
                                                                                             "256"])
    assert row["measured"]["host"] == "a" and row["measured"]["vllm_version"] == "0.34.0"
    assert row["measured"]["results"]["output_throughput"] == 500
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\dZ", row["measured"]["date"])
    # The bundled 2xA10 row is replaced; the other rows stay, so the file is a whole table.
    assert [r["name"] for r in yaml.safe_load(table.read_text())["rows"]][:2] == ["1xA10", "calibrated-2xA10"]

    assert main(["plan", "-i", str(inv), "--table", str(table), "--json"]) == ExitCode.OK
    (planned,) = json.loads(capsys.readouterr().out)["hosts"]
    source = f"calibrated-2xA10, measured on a at {row['measured']['date']} (vLLM 0.34.0)"
    assert planned["row"] == source and planned["instances"][0]["tensor_parallel_size"] == 1
    assert main(["explain", "-i", str(inv), "--table", str(table), "a", "--json"]) == ExitCode.OK
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["tensor_parallel_size"] == {"value": 1, "source": f"row {source}"}
    assert settings["extra_args"] == {"value": ["--max-num-seqs", "256"], "source": f"row {source}"}


def test_the_release_is_restored_when_every_candidate_fails_to_start_and_nothing_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    files, release = dict(fake.files), str(fake.releases[-1]["id"])
    fake.fail_start = "--max-num-seqs"
    calibrator = _calibrator(fake, tmp_path / "saved")
    (r,) = calibrator.run(prepare(_hosts(inv), PlanContext.load(), 2))
    (cal,) = calibrator.calibrations
    assert [t.status for t in cal.trials] == ["failed", "failed"] and cal.row is None
    assert r.status is Status.FAILED and r.message.startswith("no candidate met every SLO (2 tried)")
    assert exit_code([r]) == ExitCode.FAILED
    assert fake.log.count("undo ernie-vllm-0.service") == 2  # each failed start was put back by the deploy
    _restored(fake, files, release, rolled_back=False)
    assert cal.restored is not None and "already at release" in cal.restored.message


def test_no_candidate_meeting_the_slos_exits_2_and_writes_no_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch, vllm_slo_ttft_p99_ms=10)  # the fixture's p99 TTFT is 84.8 ms
    files, release = dict(fake.files), str(fake.releases[-1]["id"])
    calibrator = _calibrator(fake, tmp_path / "saved")
    monkeypatch.setattr("ernie_deploy.orchestration.calibrate.Calibrator", lambda *a, **kw: calibrator)
    monkeypatch.setattr("ernie_deploy.cli.calibrate.connector", lambda args: connector({"a": fake}))
    code = main(["calibrate", "-i", str(inv), "--max-candidates", "2"])
    out = capsys.readouterr().out
    assert code == ExitCode.FAILED and "no candidate met every SLO (2 tried)" in out and "nothing written" in out
    assert "SLO-FAILED" in out and not (tmp_path / "calibration.yml").exists()
    _restored(fake, files, release)


def test_sigterm_mid_way_stops_the_candidates_restores_the_release_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    files, release = dict(fake.files), str(fake.releases[-1]["id"])

    def progress(host: str, what: str) -> None:
        if "vllm bench serve" in what:  # during the first candidate's bench
            os.kill(os.getpid(), signal.SIGTERM)

    calibrator = _calibrator(fake, tmp_path / "saved", progress)
    (r,) = calibrator.run(prepare(_hosts(inv), PlanContext.load(), 4))
    (cal,) = calibrator.calibrations
    assert calibrator.stopped_by == signal.SIGTERM and exit_code([r], calibrator.stopped_by) == 143
    assert len(cal.trials) == 1 and cal.stopped == "interrupted: 3 candidate(s) not tried" and cal.row is None
    assert r.status is Status.FAILED and "interrupted after 1 candidate(s)" in r.message
    assert cal.restored is not None and cal.restored.status in (Status.OK, Status.CHANGED)
    _restored(fake, files, release)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


def test_the_time_bound_leaves_the_rest_untried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    ticks = iter(range(0, 10**6, 100))
    calibrator = _calibrator(fake, tmp_path / "saved", bound=150)
    calibrator.clock = lambda: float(next(ticks))
    calibrator.run(prepare(_hosts(inv), PlanContext.load(), 4))
    (cal,) = calibrator.calibrations
    assert len(cal.trials) == 1 and cal.stopped is not None and cal.stopped.startswith("time bound (150s) reached")


def test_a_restore_that_does_not_verify_fails_with_the_rollback_to_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, inv = _deployed(tmp_path, monkeypatch)
    release = str(fake.releases[-1]["id"])
    calibrator = _calibrator(fake, tmp_path / "saved")
    canaries = prepare(_hosts(inv), PlanContext.load(), 1)
    real = calibrator._restore

    def broken(cal: Any) -> Any:
        real(cal)
        fake.active.clear()  # the instance died right after the rollback
        return real(cal)

    calibrator._restore = broken  # type: ignore[method-assign]
    (r,) = calibrator.run(canaries)
    assert r.status is Status.FAILED and f"release {release} NOT restored" in r.message
    assert r.hint == f"ernie-deploy rollback -i INV --limit a --to {release}"


# -- bad input -------------------------------------------------------------------------------------------------

def test_no_slo_is_refused_with_the_fix_before_anything_connects(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path, vllm_slo_ttft_p99_ms=None)
    data = yaml.safe_load(inv.read_text())
    data["all"]["hosts"]["a"] = {}
    inv.write_text(yaml.safe_dump(data))
    with pytest.raises(InventoryError, match="no SLO is set") as err:
        prepare(_hosts(inv), PlanContext.load(), 6)
    assert err.value.where == "a" and "vllm_slo_ttft_p99_ms" in (err.value.hint or "")
    assert main(["calibrate", "-i", str(inv)]) == ExitCode.INPUT
    assert "no SLO is set" in capsys.readouterr().err


def test_a_host_without_a_deployed_release_is_refused_untouched(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))
    fake = FakeHost()
    calibrator = _calibrator(fake, tmp_path / "saved")
    (r,) = calibrator.run(prepare(_hosts(_inventory(tmp_path)), PlanContext.load(), 2))
    assert r.status is Status.FAILED and "nothing to restore" in r.message and "deploy it first" in (r.hint or "")
    assert not [c for c in fake.received if c.op in (Op.STAGE, Op.BENCH)] and not fake.files


def test_write_table_refuses_a_row_the_table_loader_would_not_accept(tmp_path: Path) -> None:
    ctx = PlanContext.load()
    out = tmp_path / "cal.yml"
    with pytest.raises(ConfigError):
        write_table(out, Path(ctx.table.path), [{"name": "x", "gpu_model": "NVIDIA A10", "gpu_count": 1,
                                                 "no_such_setting": 1}], ctx)
    assert not out.exists() and not list(tmp_path.iterdir())
