"""Provisioning without a host: the decisions (what to send, what to remove), the probe parser, the scripts'
handling of secrets, the controller's manifest and reader, the simulator wheel, and the Hub download
script run for real against a local server that answers like the Hub."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fakehub import FakeHub, serve

from ernie_deploy.errors import DeployError, InventoryError
from ernie_deploy.inventory.inventory import Host
from ernie_deploy.lab import wheel
from ernie_deploy.orchestration import localfiles
from ernie_deploy.orchestration.details import ProvisionReport
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.orchestration.provision import Provisioner, ProvisionOptions
from ernie_deploy.orchestration.results import Status
from ernie_deploy.planning.plan import PlanContext, plan_host
from ernie_deploy.planning.provisioning import (
    Entry,
    HostFile,
    HubSource,
    LocalSource,
    Recorded,
    extra_on_host,
    os_packages,
    parse_rate,
    parse_source,
    removable_venvs,
    spec_for,
    to_send,
    trusted,
    unknown_on_host,
)
from ernie_deploy.planning.settings import Secret
from ernie_deploy.remote import filesync, hub
from ernie_deploy.remote import provision as remote
from ernie_deploy.remote.command import Op
from ernie_deploy.remote.facts import version_script
from ernie_deploy.remote.ssh import RunResult

CTX = PlanContext.load()


def spec(**host_vars: object):  # type: ignore[no-untyped-def]
    host = Host("gpu-1", {"gpu_model": "NVIDIA A10", "gpu_count": 1, **host_vars})
    return spec_for(plan_host(host, CTX), host.vars, Path("/inv"))


# -- inputs ----------------------------------------------------------------------------------------------


def test_model_source_forms() -> None:
    assert parse_source("hf://baidu/ERNIE-4.5-0.3B-PT@v1.2", Path("/inv"), "h") == \
        HubSource("baidu/ERNIE-4.5-0.3B-PT", "v1.2")
    assert parse_source("hf://baidu/ERNIE-4.5-0.3B-PT", Path("/inv"), "h").revision == "main"
    assert parse_source("models/ernie", Path("/inv"), "h") == LocalSource(Path("/inv/models/ernie"))
    for bad in ("hf://baidu", "hf://a/b/c", "hf://a/b@", "hf://a/b@x y", "hf://a/b;rm -rf /"):
        with pytest.raises(InventoryError, match="not hf://ORG/NAME"):
            parse_source(bad, Path("/inv"), "h")


def test_default_venv_is_per_version_and_a_configured_bin_is_adopted() -> None:
    s = spec(vllm_version="0.33.0")
    assert (s.venv, s.bin, s.configured_bin) == ("/opt/vllm/0.33.0", "/opt/vllm/0.33.0/bin/vllm", False)
    s = spec(vllm_bin="/srv/venvs/vllm/bin/vllm")
    assert (s.venv, s.configured_bin) == ("/srv/venvs/vllm", True)
    with pytest.raises(InventoryError, match="not VENV/bin/vllm"):
        spec(vllm_bin="/usr/local/bin/vllm-wrapper")


def test_index_url_is_a_secret_and_paths_are_relative_to_the_inventory() -> None:
    s = spec(vllm_pip_index_url="https://u:pw@pypi.example/simple", vllm_pip_find_links="wheels",
             vllm_model_source="hf://org/name@abc")
    assert isinstance(s.index_url, Secret) and "pw" not in repr(s)
    assert s.find_links == Path("/inv/wheels") and s.source == HubSource("org/name", "abc")
    typo = plan_host(Host("gpu-1", {"gpu_model": "NVIDIA A10", "gpu_count": 1, "vllm_pip_index": "x"}), CTX)
    assert [e.message for e in typo.errors] == ["unknown variable vllm_pip_index"]


def test_bwlimit_rates() -> None:
    assert parse_rate("500K") == 500 * 1024 and parse_rate("2M") == 2 * 1024**2 and parse_rate(None) is None
    assert parse_rate("1.5MiB/s") == 1.5 * 1024**2
    for bad in ("fast", "0", "-1M"):
        with pytest.raises(DeployError, match="not a rate"):
            parse_rate(bad)


# -- decisions -------------------------------------------------------------------------------------------


def test_manifest_trust_needs_size_and_mtime() -> None:
    recorded = {"a": Recorded(3, "x" * 64, "1.5"), "b": Recorded(4, "y" * 64, "2.0"), "c": Recorded(5, "z" * 64, "3")}
    present = {"a": HostFile(3, "1.5"), "b": HostFile(4, "2.5"), "d": HostFile(1, "9")}  # b touched, c gone
    assert trusted(recorded, present) == {"a": Entry(3, "x" * 64)}
    wanted = {"a": Entry(3, "x" * 64), "b": Entry(4, "y" * 64), "c": Entry(5, "z" * 64)}
    held = trusted(recorded, present)
    assert to_send(wanted, held) == ["b", "c"]
    assert unknown_on_host(wanted, held, present) == ["b"]  # same size: hashing may spare the copy
    assert extra_on_host(wanted, present) == ["d"]


def test_only_marked_unused_venvs_are_removed() -> None:
    ours = ["/opt/vllm/0.11.0", "/opt/vllm/0.33.0", "/opt/vllm/0.34.0", "/srv/other"]
    assert removable_venvs(ours, {"/opt/vllm/0.33.0"}, "/opt/vllm/0.34.0") == ["/opt/vllm/0.11.0"]


def test_os_package_names_by_family() -> None:
    assert os_packages(("ubuntu", "debian")) == ("apt-get", ("python3-venv",))
    assert os_packages(("rocky", "rhel", "centos", "fedora"))[0] == "dnf"  # type: ignore[index]
    assert os_packages(("alpine",)) is None


def test_probe_parse() -> None:
    text = """
@@ernie-deploy:driver
535.104.05
rc=0
@@ernie-deploy:user
vllm:/var/lib/vllm:/usr/sbin/nologin
@@ernie-deploy:os
debian
@@ernie-deploy:python
no-venv
@@ernie-deploy:venv
ours
@@ernie-deploy:version
0.33.0
rc=0
@@ernie-deploy:venvs
/opt/vllm/0.33.0
/opt/vllm/0.11.0
@@ernie-deploy:used
/opt/vllm/0.11.0/bin/vllm
@@ernie-deploy:model-kind
dir
@@ernie-deploy:model-manifest
{"source": "/src", "files": {"config.json": {"size": 10, "sha256": "%s", "mtime": "1.25"}}}
@@ernie-deploy:model-files
10 1.25 config.json
4 2.0 dir with space/f
@@ernie-deploy:model-staged
100 abc.part
@@ernie-deploy:model-disk
2048
@@ernie-deploy:end
""" % ("c" * 64)
    f = remote.parse_probe(text)
    assert f.driver == "535.104.05" and f.user == ("vllm", "/var/lib/vllm", "/usr/sbin/nologin")
    assert f.python == "no-venv" and f.venv == "ours" and f.version == "0.33.0"
    assert f.venvs == ("/opt/vllm/0.33.0", "/opt/vllm/0.11.0") and f.used == {"/opt/vllm/0.11.0"}
    assert f.model.recorded == {"config.json": Recorded(10, "c" * 64, "1.25")} and f.model.source == "/src"
    assert f.model.present["dir with space/f"] == HostFile(4, "2.0")
    assert f.model.staged == {"abc.part": 100} and f.model.free_bytes == 2048 * 1024
    assert f.wheels.kind == "absent" and f.wheels.recorded == {}
    missing = remote.parse_probe("@@ernie-deploy:driver\nsh: nvidia-smi: not found\nrc=127\n@@ernie-deploy:end\n")
    assert missing.driver is None and "not found" in (missing.driver_error or "")
    broken = filesync.parse_dir_state({"model-manifest": "{not json"}, "model")
    assert broken.recorded == {}  # an unreadable manifest vouches for nothing


# -- secrets stay off command lines -----------------------------------------------------------------------


def test_index_url_travels_on_stdin_only() -> None:
    s = spec(vllm_pip_index_url="https://user:s3cret@pypi.example/simple")
    cmd = remote.install_command(s, None, {"action": "provision"})
    assert "s3cret" not in cmd.script and b"s3cret" in cmd.stdin
    assert "--no-index" not in cmd.script and "vllm==0.34.0" in cmd.script
    offline = remote.install_command(spec(), "/var/lib/ernie-deploy/wheelhouse", {})
    assert "--no-index" in offline.script and "--find-links /var/lib/ernie-deploy/wheelhouse" in offline.script


def test_hf_token_travels_on_stdin_only() -> None:
    s = spec(hf_token="hf_s3cret", vllm_model_source="hf://org/name@main",
             vllm_env={"HF_ENDPOINT": "https://mirror.example"})
    cmd = hub.download_command(s, HubSource("org/name", "main"), filesync.DirState("absent"), False, "hf_s3cret")
    assert "hf_s3cret" not in cmd.script and cmd.stdin == b"hf_s3cret\n"
    assert "https://mirror.example" in cmd.script


def test_scripts_quote_paths() -> None:
    weird = "/models/x y;reboot"
    assert "'/models/x y;reboot'" in filesync.probe_script("model", weird)
    cmd = filesync.switch_command(weird, {"a b": Entry(1, "d" * 64)}, [], "vllm", "/src", {})
    assert "'/models/x y;reboot.ernie-next/a b'" in cmd.script and json.loads(cmd.stdin)["files"]["a b"]["size"] == 1


# -- the controller's side of a copy --------------------------------------------------------------------


def test_scan_hashes_once_and_skips_git_and_hub_caches(tmp_path: Path) -> None:
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / ".cache").mkdir()
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"w" * 10)
    (src / ".git" / "HEAD").write_text("ref")
    (src / ".cache" / "x").write_text("x")
    cache = localfiles.HashCache(tmp_path / "hashes.json")
    m = localfiles.scan(src, cache)
    assert sorted(m) == ["config.json", "sub/w.bin"] and m["sub/w.bin"].size == 10
    cache.save()
    again = localfiles.HashCache(tmp_path / "hashes.json")
    assert str((src / "config.json").resolve()) in again.entries
    (src / "config.json").write_text('{"a": 1}')  # changed: new size and mtime, hashed again
    assert localfiles.scan(src, again)["config.json"] != m["config.json"]
    with pytest.raises(DeployError, match="not a directory"):
        localfiles.scan(tmp_path / "missing", cache)


def test_chunks_resume_at_offset_stop_early_and_respect_the_rate(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    seen: list[int] = []
    data = b"".join(localfiles.chunks(f, 1000, rate=None, sent=seen.append, stop=lambda: False))
    assert data == f.read_bytes()[1000:] and seen[-1] == len(data)
    stopped = b"".join(localfiles.chunks(f, 0, rate=None, sent=lambda n: None, stop=lambda: True))
    assert stopped == b""
    started = time.monotonic()
    slow = b"".join(localfiles.chunks(f, 0, rate=4 * 1024 * 1024, sent=lambda n: None, stop=lambda: False))
    assert len(slow) == 1024 * 1024 and time.monotonic() - started >= 0.2  # 1 MiB at 4 MiB/s


# -- the simulator as a real package ---------------------------------------------------------------------


def test_simulator_wheel_installs_with_pip_and_reports_its_version(tmp_path: Path) -> None:
    house = wheel.build_wheelhouse(tmp_path / "wheels", {"0.33.0", "0.34.0"})
    first = (house / "vllm-0.34.0-py3-none-any.whl").read_bytes()
    assert wheel.build_wheel("0.34.0", house).read_bytes() == first  # reproducible
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(house),
                    "vllm==0.33.0"], check=True, capture_output=True)
    out = subprocess.run([str(venv / "bin/vllm"), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.33.0"  # from the installed metadata, as on a lab host
    script = subprocess.run(["sh", "-c", version_script(str(venv / "bin/vllm"))], capture_output=True, text=True)
    assert script.stdout.split() == ["0.33.0", "rc=0"]


def test_preinstalled_venv_has_pips_layout(tmp_path: Path) -> None:
    py = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                        capture_output=True, text=True, check=True).stdout.strip()
    root = tmp_path / "root"
    (root / f"usr/lib/python{py}").mkdir(parents=True)
    (root / f"usr/lib/python{py}/os.py").write_text("")
    wheel.install_venv(root, "/opt/vllm/0.11.0", "0.11.0")
    venv = root / "opt/vllm/0.11.0"
    assert (venv / "bin/vllm").read_text().startswith("#!/opt/vllm/0.11.0/bin/python3\n")
    out = subprocess.run([str(venv / "bin/python3"), "-c",
                          "import importlib.metadata as m, ernie_lab_sim.vllm_sim as s; "
                          "print(m.version('vllm'), s.claimed_version())"], capture_output=True, text=True)
    assert out.stdout.split() == ["0.11.0", "0.11.0"], out.stderr


# -- the Hub download, against a local server answering like the Hub --------------------------------------


def _run_hub(cfg: dict[str, object], token: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", hub.PROGRAM, json.dumps(cfg)], input=token + "\n",
                          capture_output=True, text=True, timeout=120)


def test_hub_download_stages_files_by_sha_and_keeps_the_token_to_itself(tmp_path: Path) -> None:
    # huggingface_hub is a test dependency (pyproject's test extras): missing, the program below fails the test.
    token = "hf_TopSecretToken123"
    files = {"config.json": b'{"architectures": ["X"]}', "weights/model.safetensors": b"w" * 70_000}
    fake = FakeHub("baidu/ERNIE-4.5-0.3B-PT", files, token)
    stage = tmp_path / "stage"
    with serve(fake) as url:
        cfg = {"repo": fake.repo, "revision": "main", "stage": str(stage), "recorded": "", "intact": False,
               "endpoint": url, "mark": hub.RESULT_MARK}
        done = _run_hub(cfg, token)
        result = hub.parse_result(done.stdout)
        assert result.error is None and result.changed, done.stdout + done.stderr
        assert result.source == f"hf://{fake.repo}@{'a' * 40}"
        assert {k: v.size for k, v in result.files.items()} == {k: len(v) for k, v in files.items()}
        for rel, entry in result.files.items():
            assert (stage / entry.sha256).read_bytes() == files[rel]
        assert token not in json.dumps(cfg) and token not in done.stdout + done.stderr
        assert {auth for _, path, auth in fake.requests if fake.repo in path} == {f"Bearer {token}"}
        # The same commit, intact on the host: one question to the Hub, nothing downloaded.
        fake.requests.clear()
        again = hub.parse_result(_run_hub({**cfg, "recorded": result.source, "intact": True}, token).stdout)
        assert again.changed is False and again.source == result.source
        assert not [p for _, p, _ in fake.requests if "/resolve/" in p]
        # A wrong token: the error comes back, the token does not.
        bad = _run_hub(cfg, "hf_wrong")
        assert hub.parse_result(bad.stdout).error and "hf_wrong" not in bad.stdout


# -- the per-host flow's failure paths, against a scripted host ------------------------------------------


class ScriptedHost:
    """Answers the probe with a given text and every other command with success; records what ran."""

    def __init__(self, probe: str, answers: dict[Op, str] | None = None) -> None:
        self.answers = {Op.PROVISION_PROBE: probe, **(answers or {})}
        self.commands = 0
        self.history: list[str] = []
        self.ops: list[str] = []
        self.sent: list[Any] = []

    def run(self, cmd: Any) -> RunResult:
        self.commands += 1
        self.history.append(cmd.label)
        self.ops.append(cmd.op.name)
        self.sent.append(cmd)
        return RunResult(cmd.label, 0, self.answers.get(cmd.op, "").encode(), b"")

    def close(self) -> None:
        pass


GOOD = {"driver": "580.95.05\nrc=0", "user": "vllm:/var/lib/vllm:/usr/sbin/nologin", "os": "debian",
        "python": "ok", "venv": "absent", "version": "sh: 1: /opt/vllm/0.34.0/bin/vllm: not found\nrc=127",
        "venvs": "", "used": "", "model-kind": "absent", "model-disk": "100000000"}


def provision(tmp_path: Path, check: bool = False, answers: dict[Op, str] | None = None,
              host_vars: dict[str, Any] | None = None, **probe: str) -> tuple[Any, ScriptedHost]:
    text = "".join(f"\n@@ernie-deploy:{k}\n{v}\n" for k, v in {**GOOD, **probe}.items()) + "@@ernie-deploy:end\n"
    fake = ScriptedHost(text, answers)
    src = tmp_path / "model"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text((Path(__file__).parent.parent / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/"
                                      "config.json").read_text())
    (src / "w.bin").write_bytes(b"w" * 4096)
    host = Host("gpu-1", {"gpu_model": "NVIDIA A10", "gpu_count": 1, "vllm_model_source": str(src),
                          **(host_vars or {})})
    fleet = Fleet(lambda target: fake, FleetOptions())
    options = ProvisionOptions(base_dir=tmp_path, check=check)
    runs = Provisioner(CTX, options, fleet).run([host])
    return runs[0], fake


def test_an_old_driver_fails_before_any_change(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, driver="535.104.05\nrc=0", user="")
    assert run.result.status is Status.FAILED and "535.104.05" in run.result.message
    assert fake.ops == ["PROVISION_PROBE", "RELEASE_LOCK"]
    run, fake = provision(tmp_path, driver="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                                           "driver.\nrc=9")
    assert "no NVIDIA driver answers" in run.result.message and "580.65.06" in run.result.message
    assert fake.ops == ["PROVISION_PROBE", "RELEASE_LOCK"]


def test_missing_venv_module_names_the_package_and_installs_it_only_when_asked(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, python="no-venv")
    assert run.result.status is Status.FAILED and "install python3-venv" in run.result.message
    assert "vllm_install_os_packages" in (run.result.hint or "")
    assert "OS_PACKAGES" not in fake.ops and "INSTALL_VLLM" not in fake.ops


def test_a_foreign_venv_with_another_version_is_left_alone(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, venv="foreign", version="0.33.0\nrc=0")
    assert run.result.status is Status.FAILED and "0.33.0" in run.result.message and "0.34.0" in run.result.message
    assert "INSTALL_VLLM" not in fake.ops
    run, fake = provision(tmp_path, venv="foreign", version="0.34.0\nrc=0")  # matching metadata: adopted
    assert "INSTALL_VLLM" not in fake.ops and run.result.detail_of(ProvisionReport).vllm["state"] == "adopted"


def test_a_venv_in_use_is_never_reinstalled_in_place(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, venv="ours", version="0.33.0\nrc=0", used="/opt/vllm/0.34.0/bin/vllm")
    assert run.result.status is Status.FAILED and "switch them silently" in run.result.message
    assert "INSTALL_VLLM" not in fake.ops


def test_too_little_disk_fails_before_copying(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, **{"model-disk": "10"})  # 10 KiB free
    assert run.result.status is Status.FAILED and "free there" in run.result.message
    assert "RECEIVE" not in fake.ops and "SWITCH" not in fake.ops


def test_check_mode_takes_no_lock_and_changes_nothing(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, check=True, user="")
    assert fake.ops == ["PROVISION_PROBE"]
    assert [a["status"] for a in run.result.detail_of(ProvisionReport).actions] == \
        ["ok", "would change", "ok", "would change", "would change"]


def test_a_hub_download_is_switched_in_and_its_token_goes_to_stdin_only(tmp_path: Path) -> None:
    result = {"changed": True, "commit": "c" * 40, "source": "hf://org/name@" + "c" * 40,
              "files": {"config.json": {"size": 2, "sha256": "d" * 64}}}
    run, fake = provision(tmp_path, venv="ours", version="0.34.0\nrc=0",
                          answers={Op.HUB_DOWNLOAD: hub.RESULT_MARK + json.dumps(result)},
                          host_vars={"vllm_model_source": "hf://org/name@main", "hf_token": "hf_Sekr1t",
                                     "vllm_model_config": str(tmp_path / "model")})
    assert run.result.status is Status.CHANGED, run.result.message
    assert fake.ops == ["PROVISION_PROBE", "HUB_DOWNLOAD", "SWITCH", "RELEASE_LOCK"]
    download, switch = fake.sent[1], fake.sent[2]
    assert download.stdin == b"hf_Sekr1t\n" and "hf_Sekr1t" not in download.script
    assert json.loads(switch.stdin)["source"] == result["source"] and "hf_Sekr1t" not in switch.script
    assert "hf_Sekr1t" not in json.dumps(run.result.detail_of(ProvisionReport).to_json())
    failed = {"error": "HfHubHTTPError: 401 for token hf_Sekr1t"}
    run, fake = provision(tmp_path, venv="ours", version="0.34.0\nrc=0",
                          answers={Op.HUB_DOWNLOAD: hub.RESULT_MARK + json.dumps(failed)},
                          host_vars={"vllm_model_source": "hf://org/name@main", "hf_token": "hf_Sekr1t",
                                     "vllm_model_config": str(tmp_path / "model")})
    assert run.result.status is Status.FAILED and "hf_Sekr1t" not in run.result.message
    assert "[REDACTED]" in run.result.message and "SWITCH" not in fake.ops


def test_a_full_disk_is_named_before_the_vllm_install(tmp_path: Path) -> None:
    """The venv's disk is checked before anything is copied or installed, naming the mount point, the space
    needed (4 times the wheelhouse) and the space free (issue 23, item 9)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "vllm-0.34.0-py3-none-any.whl").write_bytes(b"w" * (100 * 1024 * 1024))
    links = {"vllm_pip_find_links": str(wheels)}
    run, fake = provision(tmp_path, host_vars=links, **{"venv-disk": "204800 /opt", "wheels-mount": "/var"})
    assert run.result.status is Status.FAILED
    message = run.result.message
    assert "/opt" in message and "400.0 MiB" in message and "200.0 MiB free" in message, message
    assert "free space on /opt" in (run.result.hint or "")
    assert "INSTALL_VLLM" not in fake.ops and "RECEIVE" not in fake.ops
    # The wheelhouse copy counts too when it lands on the same disk; with room enough, the install goes ahead.
    run, fake = provision(tmp_path, host_vars=links, **{"venv-disk": str(600 * 1024) + " /", "wheels-mount": "/"})
    assert run.result.status is Status.FAILED and "500.0 MiB" in run.result.message
    run, fake = provision(tmp_path, host_vars=links, **{"venv-disk": str(900 * 1024) + " /", "wheels-mount": "/"})
    assert "INSTALL_VLLM" in fake.ops, run.result.message
    # From an index, with nothing to measure: the documented estimate.
    run, fake = provision(tmp_path, **{"venv-disk": str(4 * 1024 * 1024) + " /srv/big disk"})
    assert "10.0 GiB" in run.result.message and "/srv/big disk" in run.result.message
    assert "INSTALL_VLLM" not in fake.ops


class FullDiskHost(ScriptedHost):
    def run(self, cmd: Any) -> RunResult:
        if cmd.op is Op.INSTALL_VLLM:
            self.ops.append(cmd.op.name)
            return RunResult(cmd.label, 1, b"", b"Error: Command '['/opt/vllm/0.34.0/bin/python3', '-m', 'ensurepip', "
                                                b"'--upgrade', '--default-pip']' returned non-zero exit status 1.\n"
                                                b"OSError: [Errno 28] No space left on device\n")
        return super().run(cmd)


def test_no_space_left_during_the_install_is_named_as_a_full_disk(tmp_path: Path) -> None:
    text = "".join(f"\n@@ernie-deploy:{k}\n{v}\n" for k, v in
                   {**GOOD, "venv-disk": str(50 * 1024 * 1024) + " /opt"}.items()) + "@@ernie-deploy:end\n"
    fake = FullDiskHost(text)
    host = Host("gpu-1", {"gpu_model": "NVIDIA A10", "gpu_count": 1})
    (run,) = Provisioner(CTX, ProvisionOptions(base_dir=tmp_path), Fleet(lambda t: fake, FleetOptions())).run([host])
    assert run.result.status is Status.FAILED and "INSTALL_VLLM" in fake.ops
    assert "ran out of disk space" in run.result.message and "/opt" in run.result.message
    assert "wheelhouse" not in (run.result.hint or "") and "free space on /opt" in (run.result.hint or "")


def test_a_cpu_build_from_an_index_needs_less_room(tmp_path: Path) -> None:
    run, fake = provision(tmp_path, host_vars={"vllm_version": "0.32.0+cpu"},
                          **{"venv-disk": str(3 * 1024 * 1024) + " /"})
    assert "4.0 GiB" in run.result.message and "a CPU build" in run.result.message, run.result.message
    assert "INSTALL_VLLM" not in fake.ops
