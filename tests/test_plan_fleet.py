"""`plan` for fleets (issue 38): one line per host, identical hosts folded into one (gpu-a10-[01:40]), each finding
once with the hosts it applies to, nothing cut on a narrow terminal; the per-instance tables with -v or for one
host."""

from __future__ import annotations

from pathlib import Path

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.output.folding import fold_names


@pytest.mark.parametrize(("names", "folded"), [
    (["gpu-a10-02.dc1", "gpu-a10-03.dc1"], "gpu-a10-[02:03].dc1"),
    ([f"gpu-{i:03d}" for i in range(1, 101)], "gpu-[001:100]"),
    (["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"], "rack1-n[01:02], rack2-n[01:02]"),
    (["a1", "a3", "a4", "b"], "a1, a[3:4], b"),
    (["h1", "h10"], "h1, h10"),
    (["web", "web"], "web"),
])
def test_names_fold_as_inventory_ranges(names: list[str], folded: str) -> None:
    assert fold_names(names) == folded


def fleet(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "fleet.yml"
    hosts = "".join(f"        gpu-a10-{i:03d}.dc1:\n" for i in range(1, n + 1))
    path.write_text("all:\n  children:\n    a10:\n      vars: {gpu_model: NVIDIA A10, gpu_count: 2}\n"
                    f"      hosts:\n{hosts}    odd:\n      hosts:\n        gpu-x:\n"
                    "          {gpu_model: NVIDIA A10, gpu_count: 4, vllm_tensor_parallel_size: 3}\n")
    return path


def test_a_hundred_identical_hosts_plan_in_a_few_lines_with_each_finding_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-i", str(fleet(tmp_path, 100))]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 15, "\n".join(lines)
    (row,) = [ln for ln in lines if ln.startswith("gpu-a10-[001:100].dc1 ")]
    assert "2 × NVIDIA A10" in row and "2xA10" in row and "1 × TP 2" in row and row.rstrip().endswith("ok")
    (odd,) = [ln for ln in lines if ln.startswith("gpu-x ")]
    assert odd.rstrip().endswith("1 error(s)")
    advice = [ln for ln in lines if ln.startswith("advice [tp-small-model] gpu-a10-[001:100].dc1: ")]
    assert len(advice) == 1
    assert [ln for ln in lines if ln.startswith("error [tp-heads] gpu-x ernie-vllm-0: TP 3 does not divide")]
    assert lines[-1] == "101 host(s), 1 with errors: gpu-x"
    assert not [ln for ln in lines if "[idle-gpus]" in ln]  # gpu-x's error fix changes its layout anyway


def test_one_host_or_v_shows_the_instance_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = fleet(tmp_path, 3)
    assert main(["plan", "-i", str(path), "--limit", "gpu-a10-001.dc1"]) == 0
    one = capsys.readouterr().out
    assert "KV tokens" in one and "[tp-small-model]" in one
    main(["plan", "-i", str(path), "-v"])
    every = capsys.readouterr().out
    assert every.count("KV tokens") == 4


def test_idle_gpus_are_a_finding_with_a_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """3 instances on a 4-GPU host, a TP-2 instance on 4 GPUs: GPUs paid for and idle (issue 38)."""
    import json
    path = tmp_path / "inv.yml"
    path.write_text("a:\n  vars: {gpu_model: NVIDIA A10, gpu_count: 4}\n  hosts:\n"
                    "    three: {vllm_instances: 3, vllm_tensor_parallel_size: 1}\n"
                    "    half: {vllm_tensor_parallel_size: 2}\n"
                    "    full: {vllm_instances: 2, vllm_tensor_parallel_size: 2}\n")
    assert main(["plan", "-i", str(path), "--json"]) == 0
    idle = {h["host"]: f for h in json.loads(capsys.readouterr().out)["hosts"] for f in h["findings"]
            if f["code"] == "idle-gpus"}
    assert set(idle) == {"three", "half"}
    assert idle["three"]["message"] == "GPU(s) 3 of 4 are used by no instance"
    assert idle["three"]["fix"] == "set vllm_instances to 4 (one instance per 1 GPU(s))"
    assert idle["half"]["message"] == "GPU(s) 2, 3 of 4 are used by no instance"


def test_ernie_ignore_silences_a_deliberate_choice_but_never_an_error(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import json
    path = tmp_path / "inv.yml"
    path.write_text("a:\n  vars: {gpu_model: NVIDIA A10, gpu_count: 4, ernie_ignore: [idle-gpus, tp-heads]}\n"
                    "  hosts:\n    half: {vllm_tensor_parallel_size: 2}\n    bad: {vllm_tensor_parallel_size: 3}\n"
                    "    typo: {ernie_ignore: 7}\n")
    assert main(["plan", "-i", str(path), "--json"]) == 1
    hosts = {h["host"]: h for h in json.loads(capsys.readouterr().out)["hosts"]}
    assert [f["code"] for f in hosts["half"]["silenced"]] == ["idle-gpus"]
    assert "idle-gpus" not in [f["code"] for f in hosts["half"]["findings"]]
    assert "tp-heads" in [f["code"] for f in hosts["bad"]["findings"]]  # an error stays
    assert hosts["typo"]["findings"][0]["message"] == "ernie_ignore must be a list of finding codes"
    main(["plan", "-i", str(path), "--limit", "half", "-v"])
    assert "silenced advice [idle-gpus]: GPU(s) 2, 3 of 4 are used by no instance (ernie_ignore)" in (
        capsys.readouterr().out)
    main(["plan", "-i", str(path), "--limit", "half"])
    assert "idle-gpus" not in capsys.readouterr().out


def test_the_gpu_map_shows_who_holds_each_gpu_and_how_its_memory_splits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "inv.yml"
    path.write_text("a:\n  vars: {gpu_model: NVIDIA A10}\n  hosts:\n"
                    "    three: {gpu_count: 4, vllm_instances: 3, vllm_tensor_parallel_size: 1}\n"
                    "    shared: {gpu_count: 1, vllm_instances: 2, vllm_share_gpus: true,"
                    " vllm_gpu_memory_utilization: 0.45}\n")
    main(["plan", "-i", str(path), "-v"])
    lines = capsys.readouterr().out.splitlines()
    gpus = [ln.strip() for ln in lines if ln.startswith("  GPU ")]
    assert gpus[3] == "GPU 3  idle          [........................]  free 22.49 GiB"
    assert gpus[0].startswith("GPU 0  ernie-vllm-0  [WK") and gpus[0].endswith("free 2.25 GiB")
    assert len(gpus[0].split("[")[1].split("]")[0]) == 24
    (both,) = [g for g in gpus if "ernie-vllm-0 + ernie-vllm-1" in g]
    assert both.count("W") == 3 and both.endswith("free 2.25 GiB")  # two instances' weights, and "W 1.34"
