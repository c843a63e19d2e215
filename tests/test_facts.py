"""Facts: the gather script's output parsed into values (fixtures, no host needed)."""

from pathlib import Path

import pytest

from ernie_deploy.remote.facts import gather_script, parse_facts, parse_gpus, parse_topology
from ernie_deploy.remote.systemd import parse_units

FIXTURES = Path(__file__).parent / "fixtures/facts"

# DGX A100 topology as in NVIDIA/nccl#1505 (docs/nvidia-smi.md#topology), cut to 2 GPUs.
NVLINK_TOPO = """        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV12    48-63,176-191   3               N/A
GPU1    NV12     X      48-63,176-191   3               N/A
"""


def test_parse_two_a10s() -> None:
    f = parse_facts((FIXTURES / "a10x2.txt").read_text())
    assert [g.name for g in f.gpus] == ["NVIDIA A10", "NVIDIA A10"]
    assert f.gpus[0].memory_mib == 23028 and f.gpus[0].driver == "550.127.05" and f.gpu_error is None
    assert f.nvlink is False
    assert f.systemd_version == 252
    assert f.model_config is not None and f.model_config["architectures"] == ["Ernie4_5ForCausalLM"]
    assert f.vllm_version == "0.34.0"
    assert f.files == {} and f.units == {} and f.lock_info is None


def test_topology() -> None:
    assert parse_topology(NVLINK_TOPO) is True
    assert parse_topology("        GPU0    CPU Affinity\nGPU0     X      0-7\n") is None
    assert parse_topology("") is None


def test_missing_driver_and_model_are_facts_not_failures() -> None:
    text = (FIXTURES / "a10x2.txt").read_text()
    text = text.replace(
        "0, NVIDIA A10, GPU-a1b2c3d4-0000-1111-2222-333344445555, 23028, 550.127.05\n"
        "1, NVIDIA A10, GPU-a1b2c3d4-0000-1111-2222-333344445556, 23028, 550.127.05\nrc=0",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\nrc=9")
    text = text.replace('"torch_dtype": "bfloat16"}\nrc=0', '"torch_dtype": "bfloat16"}\nrc=1')
    f = parse_facts(text)
    assert f.gpus == () and "couldn't communicate with the NVIDIA driver" in (f.gpu_error or "")
    assert f.model_config is None and f.model_error


def test_gpus_unexpected_output() -> None:
    gpus, error = parse_gpus("garbage line\nrc=0")
    assert gpus == () and "unexpected nvidia-smi output" in (error or "")


def test_units_and_hashes() -> None:
    units = parse_units("Id=ernie-vllm-0.service\nLoadState=loaded\nActiveState=active\nSubState=running\n"
                        "MainPID=4242\nInvocationID=abc\nNRestarts=0\nExecMainStartTimestampMonotonic=123456\n"
                        "UnitFileState=enabled\n\nId=ernie-vllm-1.service\nActiveState=failed\nNRestarts=3\n")
    assert units["ernie-vllm-0.service"].main_pid == 4242
    assert units["ernie-vllm-0.service"].started_monotonic == 123456
    assert units["ernie-vllm-1.service"].active_state == "failed" and units["ernie-vllm-1.service"].n_restarts == 3
    text = (FIXTURES / "a10x2.txt").read_text().replace(
        "@@ernie-deploy:files\n", "@@ernie-deploy:files\n" + "a" * 64 + "  /etc/systemd/system/ernie-vllm-0.service\n")
    assert parse_facts(text).files == {"/etc/systemd/system/ernie-vllm-0.service": "a" * 64}


def test_gather_script_quotes_paths() -> None:
    script = gather_script("/models/x y; rm -rf /", "/opt/vllm/bin/vllm")
    assert "cat '/models/x y; rm -rf /config.json'" in script
    assert "/etc/ernie-deploy/ernie-vllm-*.env" in script and "cat /etc/ernie-deploy" not in script


def test_vllm_version_comes_from_package_metadata_not_from_running_vllm(tmp_path: Path) -> None:
    """The version is the installed package's (importlib.metadata in the interpreter of the script's shebang):
    `vllm --version` imports torch first and takes 14-24 s with real vLLM, so it is only the fallback."""
    import subprocess
    import sys
    import sysconfig

    from ernie_deploy.remote.facts import version_script

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    dist = purelib / "vllm-9.8.7.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.8.7\n")
    script = tmp_path / "vllm"
    script.write_text(f"#!{venv}/bin/python\nimport sys\nprint('ran vllm'); sys.exit(3)\n")
    script.chmod(0o755)
    out = subprocess.run(["sh", "-c", version_script(str(script))], capture_output=True, text=True).stdout
    assert out.split() == ["9.8.7", "rc=0"]
    # No metadata (or a shebang through env): `vllm --version` answers, exit status and all.
    script.write_text("#!/bin/sh\necho 0.11.0\n")
    out = subprocess.run(["sh", "-c", version_script(str(script))], capture_output=True, text=True).stdout
    assert out.split() == ["0.11.0", "rc=0"]
    facts = parse_facts(f"@@ernie-deploy:vllm\n{out}@@ernie-deploy:end\n")
    assert facts.vllm_version == "0.11.0"


def test_vllm_version_keeps_its_local_label_and_pre_release() -> None:
    """The CPU build's metadata says 0.32.0+cpu: the label is what tells the planner it is a CPU build."""
    def version(out: str) -> str | None:
        return parse_facts(f"@@ernie-deploy:vllm\n{out}\nrc=0\n@@ernie-deploy:end\n").vllm_version

    assert version("0.32.0+cpu") == "0.32.0+cpu"
    assert version("0.10.1.1") == "0.10.1.1"
    assert version("0.11.0rc2.dev45+g1234abc.d20260101") == "0.11.0rc2.dev45+g1234abc.d20260101"
    assert version("INFO 12-05 [__init__.py:1] Automatically detected platform cpu.\n0.9.2") == "0.9.2"


def test_running_vllm_is_read_from_each_main_process_not_from_the_default_path(tmp_path: Path) -> None:
    """After a rollback the default venv path can hold another vLLM than the one the running process uses:
    the facts read the `vllm` program from the main process's command line and that program's own version."""
    import subprocess
    import sys
    import sysconfig
    import time

    from ernie_deploy.remote.facts import running_script

    venv = tmp_path / "opt/vllm/0.34.0"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (purelib / "vllm-0.34.0.dist-info").mkdir(parents=True)
    (purelib / "vllm-0.34.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    vllm = venv / "bin/vllm"
    # The test's process runs it with sh: it waits. Not `sleep` alone: sh may exec a script's last command, and
    # the process would no longer be the vllm program when its command line is read (seen once in a loaded run).
    vllm.write_text(f"#!{venv}/bin/python\nsleep 30\nexit 0\n")
    shims = tmp_path / "bin"
    shims.mkdir()
    # The process as systemd runs it: the script behind its interpreter (argv[0] python, argv[1] the script).
    proc = subprocess.Popen(["bash", "-c", f'exec -a {venv}/bin/python sh "$0" serve /m', str(vllm)])
    try:
        deadline = time.monotonic() + 10
        while b"serve" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # until bash has exec'd it
        # `systemctl show` of both: unit 0 runs that process, unit 1 is stopped (MainPID=0); systemd prints a
        # service's MainPID before the unit's Id.
        show = tmp_path / "show"
        show.write_text(f"MainPID={proc.pid}\nId=ernie-vllm-0.service\n\nId=ernie-vllm-1.service\nMainPID=0\n")
        out = subprocess.run(["sh", "-c", running_script(str(show))], capture_output=True, text=True,
                             env={"PATH": f"{shims}:/usr/bin:/bin"}).stdout
    finally:
        proc.kill()
        proc.wait()
    facts = parse_facts(f"@@ernie-deploy:vllm\n0.33.0\nrc=0\n@@ernie-deploy:running\n{out}@@ernie-deploy:end\n")
    assert facts.vllm_version == "0.33.0"
    assert {u: (r.bin, r.version) for u, r in facts.running.items()} == {"ernie-vllm-0.service": (str(vllm), "0.34.0")}
    assert facts.running_versions() == ["0.34.0"]
    assert facts.to_json()["running_vllm"] == {"ernie-vllm-0.service": {"bin": str(vllm), "version": "0.34.0"}}


def test_facts_text_names_the_running_vllm_beside_the_installed_one(capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.orchestration.results import HostResult
    from ernie_deploy.output.remote import show_facts

    text = (FIXTURES / "a10x2.txt").read_text().replace(
        "@@ernie-deploy:end", "@@ernie-deploy:running\nernie-vllm-0.service\t/opt/vllm/0.34.0/bin/vllm\t0.34.0\n"
        "@@ernie-deploy:units\nId=ernie-vllm-0.service\nActiveState=active\nSubState=running\nMainPID=42\n"
        "@@ernie-deploy:end").replace("@@ernie-deploy:vllm\n0.34.0", "@@ernie-deploy:vllm\n0.33.0")
    facts = parse_facts(text)
    show_facts([(HostResult("a"), facts)], {"a": None}, json=False)
    out = capsys.readouterr().out
    assert "vLLM 0.34.0 running (0.33.0 installed)" in out
    assert "ernie-vllm-0.service: active/running pid 42 vLLM 0.34.0 (/opt/vllm/0.34.0/bin/vllm)" in out


def test_vllm_version_is_read_without_starting_the_interpreter_where_the_venv_holds_one(tmp_path: Path) -> None:
    """A venv's site-packages with one vllm dist-info: the shell reads its METADATA (no Python starts on the host,
    which on a small host is most of a no-change run); two of them (a broken install): the interpreter decides."""
    import subprocess

    from ernie_deploy.remote.facts import version_script

    venv, ran = tmp_path / "venv", tmp_path / "ran"
    site = venv / "lib/python3.12/site-packages"
    (site / "vllm-0.32.0+cpu.dist-info").mkdir(parents=True)
    (site / "vllm-0.32.0+cpu.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: vllm\n"
                                                              "Version: 0.32.0+cpu\nSummary: x\n")
    (venv / "bin").mkdir()
    python = venv / "bin/python3"
    python.write_text(f"#!/bin/sh\necho started >> {ran}\necho 7.7.7\n")  # stands in for the interpreter
    python.chmod(0o755)
    script = venv / "bin/vllm"
    script.write_text(f"#!{python}\n")
    out = subprocess.run(["sh", "-c", version_script(str(script))], capture_output=True, text=True).stdout
    assert out.split() == ["0.32.0+cpu", "rc=0"] and not ran.exists()
    (site / "vllm-0.31.0.dist-info").mkdir()
    (site / "vllm-0.31.0.dist-info/METADATA").write_text("Name: vllm\nVersion: 0.31.0\n")
    out = subprocess.run(["sh", "-c", version_script(str(script))], capture_output=True, text=True).stdout
    assert out.split() == ["7.7.7", "rc=0"] and ran.read_text() == "started\n"


@pytest.mark.parametrize(("gpus", "topo"), [(1, False), (2, True)])
def test_topology_is_read_only_on_hosts_with_more_than_one_gpu(tmp_path: Path, gpus: int, topo: bool) -> None:
    import subprocess

    calls = tmp_path / "calls"
    rows = "".join(f"{i}, NVIDIA A10, GPU-{i}, 23028, 550.54\\n" for i in range(gpus))
    shim = tmp_path / "nvidia-smi"
    shim.write_text(f'#!/bin/sh\necho "$1" >> {calls}\ncase "$1" in topo) printf "GPU0 X NV4\\nGPU1 NV4 X\\n";; '
                    f'*) printf "{rows}";; esac\n')
    shim.chmod(0o755)
    out = subprocess.run(["bash", "-c", gather_script(str(tmp_path / "model"), str(tmp_path / "vllm"))],
                         capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}).stdout
    facts = parse_facts(out)
    assert len(facts.gpus) == gpus
    assert ("topo" in calls.read_text().split()) is topo
    assert facts.nvlink is (True if topo else None)


def _health_server(status: int) -> tuple[object, int]:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # as uvicorn answers, also to an HTTP/1.0 request

        def do_GET(self) -> None:
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_health_is_read_by_the_shell_without_starting_python(tmp_path: Path) -> None:
    """Each unit's /health through bash's /dev/tcp (no Python on the host): its status, a refused connection and
    an instance that accepts but never answers are each one `UNIT ...` line, as the Python reader prints them;
    a host without bash gets the Python reader."""
    import shutil
    import socket
    import subprocess
    import time

    from ernie_deploy.remote.facts import HEALTH_TIMEOUT_S, health_script

    ok, ok_port = _health_server(200)
    sick, sick_port = _health_server(503)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    mute_port = mute.getsockname()[1]
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\necho started >> {tmp_path / 'ran'}\nexec {shutil.which('python3')} \"$@\"\n")
    python.chmod(0o755)
    args = ["a.service", "0.0.0.0", str(ok_port), "b.service", "127.0.0.1", str(sick_port),
            "c.service", "127.0.0.1", "1", "d.service", "127.0.0.1", str(mute_port)]
    try:
        t0 = time.monotonic()
        out = subprocess.run(["sh", "-c", health_script(), "sh", *args], capture_output=True, text=True, timeout=30,
                             env={"PATH": f"{tmp_path}:/usr/bin:/bin"}).stdout.splitlines()
        took = time.monotonic() - t0
        no_bash = tmp_path / "nobash"
        no_bash.mkdir()
        for tool in ("head", "timeout"):
            (no_bash / tool).symlink_to(shutil.which(tool) or tool)
        (no_bash / "python3").symlink_to(python)
        fallback = subprocess.run(["/bin/sh", "-c", health_script(), "sh", *args[:6]], capture_output=True, text=True,
                                  timeout=30, env={"PATH": str(no_bash)}).stdout.splitlines()
    finally:
        ok.shutdown()  # type: ignore[attr-defined]
        sick.shutdown()  # type: ignore[attr-defined]
        mute.close()
    assert out[:3] == ["a.service 200", "b.service 503", "c.service error Connection refused"]
    assert out[3] == f"d.service error no HTTP status line from 127.0.0.1:{mute_port}" or \
        out[3] == f"d.service error no answer within {HEALTH_TIMEOUT_S}s"
    assert len(out) == 4 and took < HEALTH_TIMEOUT_S + 2  # the mute one is given up on, the rest not slowed
    assert fallback == ["a.service 200", "b.service 503"] and (tmp_path / "ran").read_text() == "started\n"
    facts = parse_facts("@@ernie-deploy:health\n" + "\n".join(out) + "\n@@ernie-deploy:end\n")
    assert facts.health == {"a.service": "200", "b.service": "503", "c.service": "error Connection refused",
                            "d.service": out[3].split(" ", 1)[1]}
    assert health_script() in gather_script("/m", "/v/bin/vllm")


def test_one_awk_reads_every_units_bind_port_and_gpus(tmp_path: Path) -> None:
    """The unit table: the last --host/--port of the first ExecStart naming them (quotes dropped), vLLM's
    defaults where absent, the first CUDA_VISIBLE_DEVICES; an empty unit file still gets its line."""
    import subprocess

    from ernie_deploy.remote.facts import UNIT_TABLE_AWK

    files = {"ernie-vllm-0.service": "[Service]\nEnvironment=CUDA_VISIBLE_DEVICES=0,1\n"
                                     "Environment=CUDA_VISIBLE_DEVICES=3\nExecStart=/v/bin/vllm serve /m "
                                     "--host '127.0.0.5' --port 8001 --tensor-parallel-size 2\n"
                                     "ExecStart=/v/bin/vllm serve /m --host 10.0.0.1 --port 9\n",
             "ernie-vllm-1.service": "",
             "ernie-vllm-2.service": "ExecStart=/v/bin/vllm serve /m\n",
             "ernie-vllm-3.service": 'ExecStart=/v/bin/vllm serve /m --host "::" --port 80 --port 8002\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out = subprocess.run(["awk", UNIT_TABLE_AWK, *(str(tmp_path / n) for n in files)], capture_output=True,
                         text=True, check=True).stdout
    assert [line.split(" ") for line in out.splitlines()] == [
        ["ernie-vllm-0.service", "127.0.0.5", "8001", "0,1"], ["ernie-vllm-1.service", "0.0.0.0", "8000", ""],
        ["ernie-vllm-2.service", "0.0.0.0", "8000", ""], ["ernie-vllm-3.service", "::", "8002", ""]]


def test_the_facts_script_reads_every_unit_with_one_systemctl_show_and_hashes_with_one_sha256sum(
        tmp_path: Path) -> None:
    """The whole script against a tree of managed files (its host paths moved under tmp_path) and a systemctl
    and nvidia-smi that log their calls: every section parses as before, the units' state comes from one
    `systemctl show` of all of them and the files from one sha256sum and one stat per field; the running
    instance's vLLM is read from that show's MainPID."""
    import shlex
    import subprocess
    import sys
    import time

    from ernie_deploy.planning.hostpaths import ENV_DIR, LOCK_DIR, PENDING_FILE, UNIT_DIR

    root, shims, calls = tmp_path / "root", tmp_path / "bin", tmp_path / "calls"
    units, envs = root / UNIT_DIR.lstrip("/"), root / ENV_DIR.lstrip("/")
    for d in (units, envs, shims, root / LOCK_DIR.lstrip("/")):
        d.mkdir(parents=True)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    vllm = venv / "bin/vllm"
    vllm.write_text(f"#!{sys.executable}\nsleep 30\n")  # run by sh below: it waits
    for k in (0, 1):
        (units / f"ernie-vllm-{k}.service").write_text(
            f"[Service]\nEnvironment=CUDA_VISIBLE_DEVICES={k}\nExecStart={vllm} serve /m --host 127.0.0.1 "
            f"--port {18000 + k}\n")
        (envs / f"ernie-vllm-{k}.env").write_text(f"VLLM_K={k}\n")
    (root / LOCK_DIR.lstrip("/") / "info").write_text("holder\n")
    (root / PENDING_FILE.lstrip("/")).write_text("ernie-vllm-1.service r1\n")
    proc = subprocess.Popen(["bash", "-c", f'exec -a {sys.executable} sh "$0" serve /m', str(vllm)])
    try:
        deadline = time.monotonic() + 10
        while str(vllm).encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes() and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        for tool, body in {
            "systemctl": 'echo "systemctl $*" >> CALLS\ncase $1 in --version) echo "systemd 252 (252.39)"; '
                         'echo "+PAM";; show) shift 4; for u; do [ "$u" = ernie-vllm-0.service ] && '
                         'echo "MainPID=THEPID" || echo MainPID=0; printf "Id=%s\\nActiveState=active\\n'
                         'SubState=running\\n\\n" "$u"; done;; esac',
            "nvidia-smi": 'echo "nvidia-smi $*" >> CALLS\necho "0, NVIDIA A10, GPU-0, 23028, 550.54"',
            "sha256sum": 'echo "sha256sum $#" >> CALLS\nexec /usr/bin/sha256sum "$@"',
            "stat": 'echo "stat $#" >> CALLS\nexec /usr/bin/stat "$@"',
        }.items():
            (shims / tool).write_text("#!/bin/sh\n" + body.replace("CALLS", shlex.quote(str(calls)))
                                      .replace("THEPID", str(proc.pid)) + "\n")
            (shims / tool).chmod(0o755)
        script = gather_script("/models/m", str(vllm))
        for path in (PENDING_FILE, LOCK_DIR, ENV_DIR, UNIT_DIR):
            script = script.replace(path, str(root) + path)
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                             env={"PATH": f"{shims}:/usr/bin:/bin"}).stdout
    finally:
        proc.kill()
        proc.wait()
    facts = parse_facts(out)
    unit_files = [str(units / f"ernie-vllm-{k}.service") for k in (0, 1)]
    env_files = [str(envs / f"ernie-vllm-{k}.env") for k in (0, 1)]
    assert sorted(facts.files) == sorted(unit_files + env_files) == sorted(facts.mtimes) == sorted(facts.ctimes)
    assert sorted(facts.units) == ["ernie-vllm-0.service", "ernie-vllm-1.service"]
    assert facts.units["ernie-vllm-0.service"].main_pid == proc.pid
    assert facts.unit_gpus == {"ernie-vllm-0.service": (0,), "ernie-vllm-1.service": (1,)}
    assert facts.systemd_version == 252 and [g.name for g in facts.gpus] == ["NVIDIA A10"]
    assert facts.lock_info == "holder" and facts.pending_from == {"ernie-vllm-1.service": "r1"}
    assert set(facts.health) == {"ernie-vllm-0.service", "ernie-vllm-1.service"}
    assert all(h.startswith("error") for h in facts.health.values())  # nothing listens on 18000/18001
    assert list(facts.running) == ["ernie-vllm-0.service"] and facts.running["ernie-vllm-0.service"].bin == str(vllm)
    logged = calls.read_text().splitlines()
    shows = [c for c in logged if c.startswith("systemctl show")]
    assert len(shows) == 1 and shows[0].endswith("ernie-vllm-0.service ernie-vllm-1.service"), logged
    assert [c for c in logged if c.startswith(("sha256sum", "stat"))] == ["sha256sum 4", "stat 6", "stat 6"]


def test_the_shell_reads_the_monotonic_clock_in_microseconds_as_awk_did() -> None:
    """NOW (remote/systemd.py) turns /proc/uptime's seconds into µs with the shell alone; it agrees with the
    awk it replaced, and a line of another shape still goes to awk."""
    import subprocess

    from ernie_deploy.remote.systemd import NOW

    awk = "awk '{printf \"%.0f\\n\", $1 * 1000000}' /proc/uptime"
    shell, reference = (int(subprocess.run(["sh", "-c", s], capture_output=True, text=True, check=True).stdout)
                        for s in (NOW, awk))
    assert 0 <= reference - shell < 2_000_000
    read, _, rest = NOW.partition("; ")
    assert read == "read -r up _ < /proc/uptime"
    odd = subprocess.run(["sh", "-c", "up=7.5; " + rest], capture_output=True, text=True, check=True).stdout
    assert odd.strip().isdigit()
