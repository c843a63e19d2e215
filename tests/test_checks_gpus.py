"""nvidia-smi parsing and GPU balance/ownership checks. Rows use the real A10 total
(23028 MiB, docs/nvidia-smi.md#gpu-names-and-memory) and the simulator's output format (fields joined by ", ",
no header, no units)."""

from __future__ import annotations

import pytest

from ernie_deploy.checks.gpus import check_gpus, parse_compute_apps, parse_gpu_rows
from ernie_deploy.checks.result import CheckInputError

U0, U1, U2, U3 = (f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(4))
# Captured from the lab simulator (nvidia_smi.py) with a TP=2 instance up on GPUs 0 and 1.
SIM_GPUS = f"0, {U0}, 21186, 23028, 0\n1, {U1}, 21186, 23028, 0\n"
SIM_APPS = f"743, 21186, {U0}\n744, 21186, {U1}\n"


def gpu_text(*rows: tuple[int, float, float]) -> str:
    uuids = [U0, U1, U2, U3]
    return "".join(f"{i}, {uuids[i]}, {used:.0f}, 23028, {util:.0f}\n" for i, used, util in rows)


def status(results: list) -> dict[str, str]:
    return {r.name: r.status for r in results}


def test_parse_sim_output() -> None:
    rows = parse_gpu_rows(SIM_GPUS)
    assert [(g.index, g.uuid, g.memory_used_mib, g.memory_total_mib, g.utilization_gpu) for g in rows] == [
        (0, U0, 21186, 23028, 0), (1, U1, 21186, 23028, 0)]
    apps = parse_compute_apps(SIM_APPS)
    assert [(a.pid, a.used_memory_mib, a.gpu_uuid) for a in apps] == [(743, 21186, U0), (744, 21186, U1)]


def test_parse_tolerates_units_header_and_na() -> None:
    text = (f"index, uuid, memory.used [MiB], memory.total [MiB], utilization.gpu [%]\n"
            f"0, {U0}, 600 MiB, 23028 MiB, [N/A]\n")
    [g] = parse_gpu_rows(text)
    assert g.memory_used_mib == 600 and g.utilization_gpu is None
    assert parse_compute_apps("") == []
    assert parse_compute_apps(f"12, [N/A], {U0}\n")[0].used_memory_mib is None


@pytest.mark.parametrize("text", ["0, GPU-x, 1\n", "zero, GPU-x, 1, 2, 3\n", "0, GPU-x, lots, 23028, 1\n"])
def test_parse_errors_are_clear(text: str) -> None:
    with pytest.raises(CheckInputError, match="nvidia-smi --query-gpu line 1"):
        parse_gpu_rows(text)


def test_healthy_sim_instance_passes() -> None:
    res = check_gpus(SIM_GPUS, SIM_APPS, instance_gpus=(0, 1), instance_pids={700, 742, 743, 744})
    assert set(status(res).values()) == {"pass"}


def test_memory_spread_2_gib_fails() -> None:
    res = check_gpus(gpu_text((0, 21186, 50), (1, 19138, 50)), "", instance_gpus=(0, 1), instance_pids={1})
    r = next(r for r in res if r.name == "gpu_memory_balance")
    assert r.status == "fail" and "2048 MiB" in r.summary and "GPU 1: 19138 MiB" in r.summary


def test_memory_spread_within_half_gib_passes() -> None:
    res = check_gpus(gpu_text((0, 21186, 50), (1, 20700, 52)), "", instance_gpus=(0, 1), instance_pids={1})
    assert status(res)["gpu_memory_balance"] == "pass"


def test_utilization_spread_20_points_fails() -> None:
    res = check_gpus(gpu_text((0, 21186, 70), (1, 21186, 50)), "", instance_gpus=(0, 1), instance_pids={1})
    r = next(r for r in res if r.name == "gpu_utilization_balance")
    assert r.status == "fail" and "20 points" in r.summary


def test_foreign_pid_on_instance_gpu_fails_but_not_on_other_gpus() -> None:
    apps = SIM_APPS + f"999, 2000, {U1}\n555, 3000, {U2}\n"
    res = check_gpus(SIM_GPUS + gpu_text((2, 3000, 0)), apps, instance_gpus=(0, 1), instance_pids={743, 744})
    r = next(r for r in res if r.name == "gpu_foreign_processes")
    assert r.status == "fail" and "999" in r.summary and "555" not in r.summary
    assert r.evidence == (f"pid 999 uses 2000.0 MiB on GPU 1 ({U1})",)


def test_idle_gpu_in_tp_group_fails() -> None:
    gpus = gpu_text((0, 21186, 40), (1, 21186, 40), (2, 21186, 40), (3, 3, 0))
    apps = f"10, 21186, {U0}\n11, 21186, {U1}\n12, 21186, {U2}\n"
    res = check_gpus(gpus, apps, instance_gpus=(0, 1, 2, 3), instance_pids={10, 11, 12})
    r = next(r for r in res if r.name == "gpus_in_use")
    assert r.status == "fail" and "[3]" in r.summary
    assert status(res)["gpu_memory_balance"] == "fail"


def test_gpu_held_only_by_foreign_process_is_not_in_use_by_instance() -> None:
    apps = f"10, 21186, {U0}\n99, 21186, {U1}\n"
    res = check_gpus(SIM_GPUS, apps, instance_gpus=(0, 1), instance_pids={10})
    assert status(res)["gpus_in_use"] == "fail"


def test_no_process_list_falls_back_to_memory() -> None:
    # Containers often hide compute apps; a full GPU then counts as in use, an idle one does not.
    assert status(check_gpus(SIM_GPUS, "", instance_gpus=(0, 1), instance_pids={1}))["gpus_in_use"] == "pass"
    idle = gpu_text((0, 21186, 0), (1, 500, 0))
    assert status(check_gpus(idle, "", instance_gpus=(0, 1), instance_pids={1}))["gpus_in_use"] == "fail"


def test_missing_gpu_and_missing_pids() -> None:
    [r] = check_gpus(SIM_GPUS, SIM_APPS, instance_gpus=(0, 3), instance_pids={743})
    assert r.name == "gpus_present" and r.status == "fail" and "[3]" in r.summary
    res = check_gpus(SIM_GPUS, SIM_APPS, instance_gpus=(0, 1), instance_pids=set())
    assert status(res)["gpu_foreign_processes"] == "warn"


def test_single_gpu_instance_is_balanced() -> None:
    res = check_gpus(SIM_GPUS, SIM_APPS, instance_gpus=(1,), instance_pids={744}, instance="vllm-ernie-1")
    assert set(status(res).values()) == {"pass"}
    assert {r.instance for r in res} == {"vllm-ernie-1"}
