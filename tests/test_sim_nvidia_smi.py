"""The simulated nvidia-smi: formats, filters, errors and live usage from the registry directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

A10 = {"name": "NVIDIA A10", "memory_total_mib": 23028}


def write_gpus(root: Path, count: int = 2, nvlink: bool = False, **gpu: object) -> list[str]:
    uuids = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(count)]
    spec = {**A10, **gpu}
    gpus = [{"index": i, "uuid": u, "pci_bus_id": f"00000000:00:{0x1B + i:02X}.0", **spec} for i, u in enumerate(uuids)]
    path = root / "etc/ernie-lab/gpus.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"driver_version": "550.127.05", "cuda_version": "12.4", "nvlink": nvlink,
                                "gpus": gpus}))
    return uuids


def smi(root: Path, *args: str, session: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ERNIE_LAB_ROOT": str(root)}
    if session is not None:
        env["ERNIE_LAB_PROC_SESSION"] = str(session)
    return subprocess.run([sys.executable, "-m", "ernie_deploy.lab.sim.nvidia_smi", *args], env=env,
                          capture_output=True, text=True, timeout=20, check=False)


def register(root: Path, key: str, pid: int, uuid: str, used: int, util: int = 0) -> None:
    directory = root / "run/ernie-lab/gpu"
    directory.mkdir(parents=True, exist_ok=True)
    procs = [{"pid": pid, "gpu_uuid": uuid, "used_mib": used, "reserved_mib": used, "process_name": "VLLM::EngineCore"}]
    (directory / f"{key}.json").write_text(json.dumps({"utilization_gpu": util, "procs": procs}))


def test_query_gpu_with_header_and_units(tmp_path: Path) -> None:
    uuids = write_gpus(tmp_path)
    out = smi(tmp_path, "--query-gpu=index,name,uuid,memory.total,memory.used,utilization.gpu", "--format=csv")
    assert out.returncode == 0
    assert out.stdout.splitlines() == [
        "index, name, uuid, memory.total [MiB], memory.used [MiB], utilization.gpu [%]",
        f"0, NVIDIA A10, {uuids[0]}, 23028 MiB, 0 MiB, 0 %",
        f"1, NVIDIA A10, {uuids[1]}, 23028 MiB, 0 MiB, 0 %",
    ]


def test_query_gpu_noheader_nounits_and_id_filter(tmp_path: Path) -> None:
    write_gpus(tmp_path, count=4)
    out = smi(tmp_path, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits", "-i", "1,3")
    assert out.stdout == "1, NVIDIA A10, 23028\n3, NVIDIA A10, 23028\n"
    out = smi(tmp_path, "--query-gpu=index,memory.free", "--format=csv,noheader", "--id=2")
    assert out.stdout == "2, 23028 MiB\n"
    assert smi(tmp_path, "--query-gpu=index", "--format=csv", "-i", "7").returncode == 6


def test_usage_registry_drives_memory_util_and_compute_apps(tmp_path: Path) -> None:
    uuids = write_gpus(tmp_path)
    register(tmp_path, "live", os.getpid(), uuids[1], 20725, util=52)
    register(tmp_path, "dead", 2**22 + 12345, uuids[0], 9999)  # no such pid: must be ignored
    out = smi(tmp_path, "--query-gpu=index,memory.used,memory.free,utilization.gpu", "--format=csv,noheader,nounits")
    assert out.stdout == "0, 0, 23028, 0\n1, 20725, 2303, 52\n"
    apps = smi(tmp_path, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
    assert apps.stdout.splitlines() == [
        "pid, process_name, used_gpu_memory [MiB], gpu_uuid",
        f"{os.getpid()}, VLLM::EngineCore, 20725 MiB, {uuids[1]}",
    ]
    assert str(os.getpid()) in smi(tmp_path).stdout  # the default table lists the process too


def test_unknown_field_fails_like_nvidia_smi(tmp_path: Path) -> None:
    write_gpus(tmp_path)
    out = smi(tmp_path, "--query-gpu=index,foo", "--format=csv")
    assert (out.returncode, out.stdout) == (2, 'Field "foo" is not a valid field to query.\n\n')
    assert smi(tmp_path, "--query-compute-apps=pid,bar", "--format=csv").returncode == 2


def test_list_gpus(tmp_path: Path) -> None:
    uuids = write_gpus(tmp_path, name="NVIDIA A100-SXM4-80GB", memory_total_mib=81920)
    assert smi(tmp_path, "-L").stdout == "".join(
        f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: {u})\n" for i, u in enumerate(uuids)
    )


@pytest.mark.parametrize(("nvlink", "expected"), [(True, {"NV12"}), (False, {"PHB", "SYS"})])
def test_topo_matrix(tmp_path: Path, nvlink: bool, expected: set[str]) -> None:
    write_gpus(tmp_path, count=4, nvlink=nvlink)
    out = smi(tmp_path, "topo", "-m").stdout
    lines = out.splitlines()
    assert lines[0].split("\t")[1:] == ["GPU0", "GPU1", "GPU2", "GPU3", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    cells = {c for line in lines[1:5] for c in line.split("\t")[1:5]} - {" X "}
    assert cells == expected
    assert "  NV#  = Connection traversing a bonded set of # NVLinks" in out


def test_no_driver_without_gpus_json(tmp_path: Path) -> None:
    out = smi(tmp_path, "-L")
    assert out.returncode == 9
    assert out.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_plain_table(tmp_path: Path) -> None:
    write_gpus(tmp_path)
    out = smi(tmp_path).stdout
    assert "Driver Version: 550.127.05" in out and "CUDA Version: 12.4" in out
    assert out.count("0MiB / 23028MiB") == 2
    assert "No running processes found" in out


# A stand-in for real vLLM's process tree: a `vllm serve` API server (its command line and environment
# intact) → an engine → workers retitled `VLLM::Worker_TP<r>` with nothing else on their command line. Each
# process runs the script it reads on stdin, so a worker's argv can be its title alone, as setproctitle leaves it
# (such a Python cannot tell its own executable, so the scripts name it).
_SLEEP = "import time\ntime.sleep(60)\n"
_SPAWN = """import subprocess, time
children = [subprocess.Popen({argvs!r}[i], executable={exe!r}, stdin=subprocess.PIPE) for i in range({n})]
for c in children:
    c.stdin.write({script!r}.encode()); c.stdin.close()
time.sleep(60)
"""


def _start(proc: subprocess.Popen[bytes], script: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(script.encode())
    proc.stdin.close()


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, 9)
    proc.wait(timeout=10)


def test_real_vllm_workers_are_compute_apps_while_they_live(tmp_path: Path) -> None:
    """Real-vLLM lab hosts: each live `VLLM::Worker_TP<r>` holds rank r's GPU of the API server's
    CUDA_VISIBLE_DEVICES, --gpu-memory-utilization of its memory; when the processes end, the GPUs are free."""
    uuids = write_gpus(tmp_path, count=4)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2,1"}
    engine = _SPAWN.format(argvs=[["VLLM::Worker_TP0"], ["VLLM::Worker_TP1"]], n=2, script=_SLEEP,
                           exe=sys.executable)
    api_script = _SPAWN.format(argvs=[["VLLM::EngineCore"]], n=1, script=engine, exe=sys.executable)
    api = subprocess.Popen([sys.executable, "-", "serve", "/models/m", "--gpu-memory-utilization", "0.5"],
                           stdin=subprocess.PIPE, env=env, start_new_session=True)
    try:
        _start(api, api_script)
        expected = {f"{uuids[2]}, 11514", f"{uuids[1]}, 11514"}
        rows: set[str] = set()
        for _ in range(100):
            out = smi(tmp_path, "--query-compute-apps=pid,process_name,gpu_uuid,used_memory",
                      "--format=csv,noheader,nounits", session=api.pid)
            rows = {", ".join(line.split(", ")[2:]) for line in out.stdout.splitlines()}
            if rows == expected:
                break
            time.sleep(0.1)
        assert rows == expected
        names = sorted(line.split(", ")[1] for line in out.stdout.splitlines())
        assert names == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
        used = smi(tmp_path, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", session=api.pid).stdout
        assert used.splitlines() == ["0, 0", "1, 11514", "2, 11514", "3, 0"]
    finally:
        _kill_tree(api)
    gone = smi(tmp_path, "--query-compute-apps=pid", "--format=csv,noheader", session=api.pid).stdout
    assert gone == ""


def test_a_worker_title_outside_vllm_serve_is_not_a_compute_app(tmp_path: Path) -> None:
    """Only workers under a `vllm serve` count: a process that merely carries the title holds nothing."""
    write_gpus(tmp_path, count=1)
    lone = subprocess.Popen(["VLLM::Worker"], executable=sys.executable, stdin=subprocess.PIPE,
                            start_new_session=True)
    try:
        _start(lone, _SLEEP)
        assert smi(tmp_path, "--query-compute-apps=pid", "--format=csv,noheader", session=lone.pid).stdout == ""
    finally:
        _kill_tree(lone)


def test_usage_is_read_once_and_only_for_fields_that_show_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The facts' static query (index, name, uuid, memory.total, driver_version) reads no usage: no registry and no
    scan of /proc, the sim's cost on every deploy's facts; memory.used, the compute apps and the table read it once
    per invocation, however many fields and GPUs show it."""
    from ernie_deploy.lab.sim import nvidia_smi

    uuids = write_gpus(tmp_path)
    register(tmp_path, "a", os.getpid(), uuids[1], 1000, util=40)
    monkeypatch.setenv("ERNIE_LAB_ROOT", str(tmp_path))
    reads: list[int] = []
    real = nvidia_smi.read_entries
    monkeypatch.setattr(nvidia_smi, "read_entries", lambda: reads.append(1) or real())
    text, code = nvidia_smi.run(["--query-gpu=index,name,uuid,memory.total,driver_version",
                                 "--format=csv,noheader,nounits"])
    assert code == 0 and text.splitlines()[1] == f"1, NVIDIA A10, {uuids[1]}, 23028, 550.127.05" and reads == []
    for args in (["--query-gpu=index,memory.used,memory.free,utilization.gpu,power.draw,pstate", "--format=csv"],
                 ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"], []):
        reads.clear()
        text, code = nvidia_smi.run(args)
        assert code == 0 and reads == [1], args
        assert "1000" in text, args
