"""Issue 25 in the lab: `bench`, the SLO gates and `calibrate` against the simulated vLLM's latency model
(docs/lab.md, "Latency model"), through the whole stack: SSH, the host program, the simulator's `vllm bench serve`.

One module fixture deploys the default lab once (simulated loads of 1 s) with a small bench workload; each scenario
leaves every host serving its base release again and its faults at QUICK, so they can share it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import clean, wait_for
from lab.loadgen import healthy
from lab.test_lab_deploy import start_times
from lab.test_lab_rollout import QUICK, faults

pytestmark = pytest.mark.lab

# Small enough that a bench takes about a second on the simulator (16 requests, 4 in flight, 32 tokens each).
WORKLOAD = {"vllm_bench_num_prompts": 16, "vllm_bench_input_len": 64, "vllm_bench_output_len": 32,
            "vllm_bench_max_concurrency": 4, "vllm_bench_timeout": 60}
# Met with room to spare by every default host (TP 1: about 4.5 ms per output token at 4 in flight), missed by a
# host whose latency is scaled tenfold (about 45 ms).
SLO = {"vllm_slo_tpot_p99_ms": 20}
FILES = "/etc/systemd/system/ernie-vllm-0.service /etc/ernie-deploy/ernie-vllm-0.env"


def inventory(state: LabState, path: Path, group: dict[str, Any],
              hosts: dict[str, dict[str, Any]] | None = None) -> Path:
    """The lab's inventory with `group` added to the simulated hosts' group vars and `hosts` to each host's."""
    data = yaml.safe_load(Path(state.inventory).read_text())
    lab_group = data["all"]["children"]["lab"]
    lab_group["vars"].update(group)
    for host, extra in (hosts or {}).items():
        lab_group["hosts"][host].update(extra)
    path.write_text(yaml.safe_dump(data))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def by_host(doc: dict[str, Any]) -> dict[str, Any]:
    hosts = doc["hosts"]
    return hosts if isinstance(hosts, dict) else {h["host"]: h for h in hosts}


@pytest.fixture(scope="module")
def fleet(lab: Lab, lab_state: LabState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every lab host deployed with its base plan and the small workload; the inventory's path."""
    clean(lab, lab_state)
    for h in lab_state.hosts:
        faults(lab, h.name, QUICK)
    os.environ["ERNIE_DEPLOY_STATE_DIR"] = str(tmp_path_factory.mktemp("bench-rollouts"))
    inv = inventory(lab_state, tmp_path_factory.mktemp("bench-inv") / "inventory.yml", WORKLOAD)
    try:
        assert main(["deploy", "-i", str(inv), "--startup-budget", "60"]) == 0
        yield inv
    finally:
        os.environ.pop("ERNIE_DEPLOY_STATE_DIR", None)
        for h in lab_state.hosts:
            lab.ssh(h.name, "rm -f /etc/ernie-lab/faults.json")
        clean(lab, lab_state)


def test_bench_measures_each_host_through_the_stack_and_tp_2_decodes_faster_than_tp_1(
        capsys: pytest.CaptureFixture[str], lab_state: LabState, fleet: Path, tmp_path: Path) -> None:
    """`bench --limit HOST` per simulated host, one after another (hosts benched together would share this
    machine's CPUs): every request completes, the numbers are there, the raw result is saved; the TP-2 host
    (a10-2) has a lower TPOT than the TP-1 host (a10-1), the latency model's property seen through SSH, the host
    program and the simulator's own `vllm bench serve`."""
    seen: dict[str, dict[str, Any]] = {}
    for h in lab_state.hosts:
        rc, doc = run(capsys, "bench", "-i", str(fleet), "--limit", h.name, "--save", str(tmp_path))
        (inst,) = by_host(doc)[h.name]["instances"]
        assert rc == 0 and inst["status"] == "ok", inst["message"]
        assert inst["message"] == "measured (no SLOs set)" and inst["verdicts"] == []
        result = inst["result"]
        assert result["completed"] == WORKLOAD["vllm_bench_num_prompts"] and not result["failed"], result
        assert not result["partial"] and result["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert {"p50", "p99"} <= set(result["latency_ms"][metric]), result["latency_ms"]
        saved = Path(inst["saved"])
        assert saved.parent == tmp_path / h.name and json.loads(saved.read_text())["completed"] == result["completed"]
        seen[h.name] = result
    tpot = {name: r["latency_ms"]["tpot"]["p50"] for name, r in seen.items()}
    assert tpot["a10-2"] < tpot["a10-1"], tpot
    with capsys.disabled():  # the README's bench table, for a run with -s
        print(f"\nbench, {WORKLOAD['vllm_bench_num_prompts']} prompts of {WORKLOAD['vllm_bench_input_len']}+"
              f"{WORKLOAD['vllm_bench_output_len']} tokens, {WORKLOAD['vllm_bench_max_concurrency']} in flight:")
        for name, r in seen.items():
            ms = r["latency_ms"]
            print(f"| {name} | {ms['ttft']['p50']:.1f} / {ms['ttft']['p99']:.1f} | {ms['tpot']['p50']:.2f} / "
                  f"{ms['tpot']['p99']:.2f} | {ms['itl']['p99']:.2f} | {r['output_throughput']:.0f} | "
                  f"{r['request_throughput']:.2f} |")


def test_a_down_instance_is_named_and_not_benched(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                  fleet: Path) -> None:
    lab.ssh("a10-4", "systemctl stop ernie-vllm-0.service")
    try:
        rc, doc = run(capsys, "bench", "-i", str(fleet), "--limit", "a10-4")
    finally:
        lab.ssh("a10-4", "systemctl start ernie-vllm-0.service")
    (inst,) = by_host(doc)["a10-4"]["instances"]
    assert rc == 2 and inst["status"] == "down" and inst["result"] is None, inst
    assert inst["message"].startswith("ernie-vllm-0 is down: http://127.0.0.13:8000/health did not answer"), inst
    assert wait_for(lambda: healthy("127.0.0.13:8000"), 60)


def test_verify_bench_passes_the_slo_and_a_canary_that_misses_it_is_rolled_back_and_stops_the_rollout(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Path, tmp_path: Path) -> None:
    """With a TPOT SLO the default hosts meet, `verify --bench` passes. Then a change (max_model_len) whose new
    release is ten times slower on a10-1 (latency_scale, only for that configuration): `deploy --canary 1` starts
    it on a10-1, the SLO gate benches it, it misses the SLO, a10-1 gets its previous release back and serves, the
    rollout stops and the other hosts are not touched (exit 2, the verdict in the evidence)."""
    slo = inventory(lab_state, tmp_path / "slo.yml", {**WORKLOAD, **SLO})
    rc, doc = run(capsys, "verify", "-i", str(slo), "--bench")
    hosts = by_host(doc)
    assert rc == 0, {h: [c for c in r["checks"] if c["status"] != "pass"] for h, r in hosts.items()}
    for name, host in hosts.items():
        checks = {c["name"]: c for c in host["checks"]}
        assert checks["bench"]["status"] == "pass" and checks["slo:tpot_p99_ms"]["status"] == "pass", (name, checks)
        assert [b["status"] for b in host["bench"]] == ["ok"], host["bench"]

    before = lab.ssh("a10-1", f"cat {FILES}").stdout
    others = {h.name: start_times(lab, h.name) for h in lab_state.hosts[1:]}
    faults(lab, "a10-1", {**QUICK, "when": {"max_model_len": 1152}, "latency_scale": 10})
    changed = inventory(lab_state, tmp_path / "changed.yml", {**WORKLOAD, **SLO, "vllm_max_model_len": 1152})
    try:
        rc, doc = run(capsys, "deploy", "-i", str(changed), "--canary", "1", "--startup-budget", "60",
                      "--gpu-release-timeout", "20")
    finally:
        faults(lab, "a10-1", QUICK)
    hosts = by_host(doc)
    canary = hosts["a10-1"]
    assert rc == 2 and doc["rollout"]["batches"][0] == ["a10-1"], [(h, r["message"]) for h, r in hosts.items()]
    assert canary["status"] == "failed" and canary["message"].startswith("SLO gate: ernie-vllm-0 slo-failed"), \
        canary["message"]
    assert any(e.startswith("SLO gate, ernie-vllm-0: TPOT p99 ") and e.endswith("> 20 ms")
               for e in canary["evidence"]), canary["evidence"]
    assert [c["status"] for c in canary["checks"] if c["name"] == "slo:tpot_p99_ms"] == ["fail"]
    assert any("rolled back to release" in x and "ready and verified" in x for x in canary["rollbacks"]), canary
    assert "first batch (canary)" in doc["rollout"]["stopped"]
    assert all(hosts[h]["status"] == "skipped" for h in others)
    assert lab.ssh("a10-1", f"cat {FILES}").stdout == before
    assert healthy("127.0.0.11:8000")
    assert {h: start_times(lab, h) for h in others} == others
    # The release that serves again is the fast one: the SLO holds on a10-1 as before.
    rc, doc = run(capsys, "verify", "-i", str(slo), "--limit", "a10-1", "--bench")
    assert rc == 0, [c for c in by_host(doc)["a10-1"]["checks"] if c["status"] != "pass"]


def test_calibrate_on_a_2_gpu_canary_picks_tp_2_writes_a_row_plan_shows_and_restores_the_release(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Path, tmp_path: Path) -> None:
    """calibrate --limit a10-2 (2 × A10) with two candidates, TP 1 and TP 2 at max_model_len 256 and 4 sequences:
    the simulator's decode step is 1.6x faster per TP doubling, so TP 2 has the lower TPOT and the higher output
    throughput, and both meet the SLO: TP 2 wins (docs/calibrate.md, "In the lab"). The row round-trips through
    `plan --table`, and a10-2 runs the release it ran before."""
    inv = inventory(lab_state, tmp_path / "inventory.yml", {**WORKLOAD, **SLO})
    before = lab.ssh("a10-2", f"cat {FILES}").stdout
    table = tmp_path / "calibration.yml"
    rc, doc = run(capsys, "calibrate", "-i", str(inv), "--limit", "a10-2", "--max-candidates", "2",
                  "--table-out", str(table), "--save", str(tmp_path / "saved"), "--startup-budget", "60")
    host = doc["hosts"]["a10-2"]
    assert rc == 0, (host["trials"], host["restored"])
    trials = {t["candidate"]["tensor_parallel_size"]: t for t in host["trials"]}
    assert [t["status"] for t in host["trials"]] == ["met", "met"], host["trials"]
    tp1, tp2 = trials[1]["measurement"], trials[2]["measurement"]
    assert tp2["tpot_p99_ms"] < tp1["tpot_p99_ms"] and tp2["output_throughput"] > tp1["output_throughput"], trials
    assert host["winner"]["candidate"] == {"tensor_parallel_size": 2, "max_model_len": 256, "max_num_seqs": 4}
    assert host["restored"]["ok"], host["restored"]
    assert lab.ssh("a10-2", f"cat {FILES}").stdout == before
    assert "--tensor-parallel-size 2" in before and healthy("127.0.0.12:8000")
    with capsys.disabled():
        print(f"\ncalibrate a10-2: TP 1 {tp1['output_throughput']:.0f} tok/s, TPOT p99 {tp1['tpot_p99_ms']:.2f} ms; "
              f"TP 2 {tp2['output_throughput']:.0f} tok/s, TPOT p99 {tp2['tpot_p99_ms']:.2f} ms")

    (row,) = [r for r in yaml.safe_load(table.read_text())["rows"] if "measured" in r]
    assert (row["tensor_parallel_size"], row["max_model_len"], row["extra_args"]) == (2, 256, ["--max-num-seqs", "4"])
    assert row["measured"]["host"] == "a10-2" and row["measured"]["vllm_version"] == "0.34.0", row["measured"]
    rc, doc = run(capsys, "plan", "-i", str(inv), "--limit", "a10-2", "--table", str(table))
    (planned,) = doc["hosts"]
    assert rc == 0 and planned["row"] == f"{row['name']}, measured on a10-2 at {row['measured']['date']} " \
                                         f"(vLLM 0.34.0)", planned["row"]
    assert planned["instances"][0]["tensor_parallel_size"] == 2 and planned["instances"][0]["max_model_len"] == 256
