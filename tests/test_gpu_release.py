"""The GPU release gate's judgement and the /metrics reading of a drain (pure)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ernie_deploy.checks.gpurelease import MARGIN_MIB, judge
from ernie_deploy.checks.gpus import ComputeApp, GpuRow
from ernie_deploy.checks.metrics import in_flight, parse_sample
from ernie_deploy.remote.rolling import parse_gpus

ROWS = [GpuRow(0, "GPU-0", 300.0, 23028.0, 0.0), GpuRow(1, "GPU-1", 20800.0, 23028.0, 0.0)]


def test_free_when_no_process_and_memory_back_at_the_baseline() -> None:
    assert judge([0], ROWS, [], {}, {0: 250.0}).free
    assert judge([0], ROWS, [], {}, {}).free  # no baseline kept: processes alone decide


def test_a_process_on_the_gpu_is_named_with_its_pid() -> None:
    verdict = judge([1], ROWS, [ComputeApp(4242, 20500.0, "GPU-1")], {4242: "VLLM::EngineCor"}, {1: 0.0})
    assert not verdict.free
    assert verdict.describe().startswith("GPU 1 held by PID 4242 (VLLM::EngineCor)")


def test_memory_above_the_baseline_holds_the_gate_without_a_listed_process() -> None:
    # The driver frees memory asynchronously: no process left, memory not back yet.
    verdict = judge([1], ROWS, [], {}, {1: 100.0})
    assert not verdict.free and verdict.high == ((1, 20800.0, 100.0 + MARGIN_MIB),)


def test_an_instance_sharing_the_gpu_is_neither_holder_nor_memory() -> None:
    sibling = ComputeApp(77, 20500.0, "GPU-1")
    assert judge([1], ROWS, [sibling], {}, {1: 0.0}, sharing={77}).free
    assert not judge([1], ROWS, [sibling], {}, {1: 0.0}).free


def test_in_flight_sums_running_and_waiting_over_engines() -> None:
    text = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n')
    assert in_flight(text) == 6
    assert in_flight("process_cpu_seconds_total 3.0\n") is None  # not vLLM: never read as idle


@pytest.mark.parametrize("name", ["m}x", 'say "hi"', "back\\slash", "two\nlines", "a,b=\"c\"}", "}"])
def test_in_flight_reads_model_names_the_exposition_format_escapes(name: str) -> None:
    # Prometheus's text format escapes \, " and line feed in label values (exposition_formats, "Text format
    # details"); `}` needs no escape. Issue 23: a `}` in the name hid every sample, so the drain waited blind.
    escaped = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    text = (f'vllm:num_requests_running{{engine="0",model_name="{escaped}"}} 2.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="{escaped}",}} 1.0 1712000000000\n')
    assert in_flight(text) == 3
    sample = parse_sample(text.splitlines()[0])
    assert sample is not None and sample.labels == {"engine": "0", "model_name": name}


@pytest.mark.parametrize("line", ['vllm:num_requests_running{model_name="a} 1.0', 'vllm:num_requests_running{x} 1',
                                  "vllm:num_requests_running{} ", "# TYPE vllm:num_requests_running gauge",
                                  'vllm:num_requests_running{a="1"b="2"} 1'])
def test_malformed_sample_lines_are_not_read(line: str) -> None:
    assert parse_sample(line) is None


def test_gpu_reading_parses_units_baselines_and_cgroups() -> None:
    text = ("@@ernie-deploy:unit ernie-vllm-0.service\nId=ernie-vllm-0.service\nActiveState=inactive\n"
            "@@ernie-deploy:baseline ernie-vllm-0.service\n0, 310\n"
            "@@ernie-deploy:gpus\n0, GPU-0, 300, 23028, 0\n"
            "@@ernie-deploy:apps\n4242, 20000, GPU-0\n"
            "@@ernie-deploy:ps\n 4242 VLLM::EngineCor\n"
            "@@ernie-deploy:cgroups\n4242 leaked.service\n")
    reading = parse_gpus(text)
    assert reading.states["ernie-vllm-0.service"].active_state == "inactive"
    assert reading.baselines == {"ernie-vllm-0.service": {0: 310.0}}
    assert reading.names == {4242: "VLLM::EngineCor"} and reading.units == {4242: "leaked.service"}


def test_simulated_metrics_escape_model_names_as_prometheus_client_does() -> None:
    from ernie_deploy.lab.sim.vllm_metrics import MetricsStore, render

    name = 'm}"\\x\n'
    text = render(MetricsStore(), {"vllm:num_requests_running": 2.0, "vllm:num_requests_waiting": 1.0}, name, {})
    assert in_flight(text) == 3
    labelled = [s for s in map(parse_sample, text.splitlines()) if s is not None and "model_name" in s.labels]
    assert labelled and {s.labels["model_name"] for s in labelled} == {name}


def test_the_stop_reads_the_gpus_in_the_same_round_trip_and_both_parse_from_its_output() -> None:
    """The gate's first reading is taken by the stop's command, right after `systemctl stop` returned (every
    process of the unit gone): one round trip fewer per instance."""
    from ernie_deploy.remote.rolling import GpuRelease, parse_stop, stop_command

    alone = stop_command("ernie-vllm-0.service", {"action": "stop"}).intent.render()
    fused = stop_command("ernie-vllm-0.service", {"action": "stop"}, ["ernie-vllm-0.service"]).intent.render()
    assert "nvidia-smi" not in alone
    reading = GpuRelease(("ernie-vllm-0.service",)).render()
    assert fused.startswith(alone) and fused.endswith(reading)
    assert fused.index("systemctl stop") < fused.index("nvidia-smi")
    out = ("@@ernie-deploy:stopped inactive\n"
           "@@ernie-deploy:unit ernie-vllm-0.service\nId=ernie-vllm-0.service\nActiveState=inactive\n"
           "@@ernie-deploy:baseline ernie-vllm-0.service\n0, 310\n"
           "@@ernie-deploy:gpus\n0, GPU-0, 300, 23028, 0\n@@ernie-deploy:apps\n@@ernie-deploy:ps\n"
           "@@ernie-deploy:cgroups\n")
    assert parse_stop(out).state == "inactive" and not parse_stop(out).killed
    got = parse_gpus(out)
    assert [r.index for r in got.rows] == [0] and not got.apps
    assert judge([0], got.rows, got.apps, got.names, got.baselines["ernie-vllm-0.service"]).free


def test_a_gpu_reading_asks_nvidia_smi_twice_and_names_the_cgroup_of_each_listed_process(tmp_path: Path) -> None:
    """The cgroups section takes its PIDs from the compute-apps query's output instead of asking nvidia-smi a
    third time (each call asks the driver again: tens of milliseconds on a real host)."""
    from ernie_deploy.remote.protocol import split
    from ernie_deploy.remote.rolling import GpuRelease

    pid = os.getpid()  # a process that exists, so /proc/PID/cgroup is read
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        f"#!/bin/sh\necho \"$*\" >> {calls}\n"
        f"case $* in *compute-apps*) echo '{pid}, 20000, GPU-0'; echo '{pid + 1}, 512, GPU-0';; "
        "*) echo '0, GPU-0, 20500, 23028, 0';; esac\n")
    (bin_dir / "systemctl").write_text("#!/bin/sh\necho Id=ernie-vllm-0.service\necho ActiveState=inactive\n")
    for program in bin_dir.iterdir():
        program.chmod(0o755)
    script = GpuRelease(("ernie-vllm-0.service",)).render()
    out = subprocess.run(["sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                         text=True, check=True).stdout
    assert len(calls.read_text().splitlines()) == 2
    reading = parse_gpus(out)
    assert [a.pid for a in reading.apps] == [pid, pid + 1] and [r.index for r in reading.rows] == [0]
    cgroups = [line.split()[0] for s in split(out) if s.header == "cgroups" for line in s.lines if line.strip()]
    assert cgroups == [str(pid), str(pid + 1)]
    unit = Path(f"/proc/{pid}/cgroup").read_text().splitlines()[-1].rsplit("/", 1)[-1]
    assert reading.units.get(pid, "") == unit
