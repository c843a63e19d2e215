"""The default lab boots real hosts: strict SSH, sudo, simulated GPUs, the files deploy code relies on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from ernie_deploy.lab import Lab, LabState, load_spec

pytestmark = pytest.mark.lab

SPEC = load_spec()
MODEL_CONFIG = Path(__file__).resolve().parents[2] / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json"


def strict_ssh(state: LabState, address: str, command: str, known_hosts: str | None = None,
               user: str = "root") -> subprocess.CompletedProcess[str]:
    """Exactly the command a user would type (not the Lab helper), so the lab's promise is tested as is."""
    return subprocess.run(
        ["ssh", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts or state.known_hosts}",
         "-o", "GlobalKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
         "-i", state.key, f"{user}@{address}", command],
        capture_output=True, text=True, timeout=60, check=False)


def test_default_lab_boots_every_host(lab: Lab, lab_state: LabState) -> None:
    statuses = lab.status()
    assert [(s.name, s.address, s.state) for s in statuses] == [
        ("a10-1", "127.0.0.11", "ssh-ready"), ("a10-2", "127.0.0.12", "ssh-ready"),
        ("a10-4", "127.0.0.13", "ssh-ready"), ("a100-2", "127.0.0.14", "ssh-ready"),
    ]
    assert lab_state.ready_seconds is not None and lab_state.ready_seconds < 60


def test_inventory_describes_the_lab(lab_state: LabState) -> None:
    inventory = yaml.safe_load(Path(lab_state.inventory).read_text())
    group = inventory["all"]["children"]["lab"]
    assert group["hosts"] == {
        h.name: {"ansible_host": h.address, "gpu_model": h.gpu_model, "gpu_count": h.gpu_count,
                 "vllm_host": h.address, "vllm_version": "0.34.0"} for h in SPEC.hosts
    }
    assert group["hosts"]["a100-2"] == {"ansible_host": "127.0.0.14", "gpu_model": "NVIDIA A100-SXM4-80GB",
                                        "gpu_count": 2, "vllm_host": "127.0.0.14", "vllm_version": "0.34.0"}
    lab_dir = Path(lab_state.dir)
    assert group["vars"] == {
        "ansible_user": "root", "ansible_port": 22, "ansible_ssh_private_key_file": lab_state.key,
        "ernie_known_hosts": lab_state.known_hosts, "vllm_model": "/models/ERNIE-4.5-0.3B-PT",
        "vllm_pip_find_links": str(lab_dir / "wheelhouse"),
        "vllm_model_source": str(lab_dir / "model-source/ERNIE-4.5-0.3B-PT"), "vllm_stable_seconds": 2,
    }
    assert (lab_dir / "wheelhouse/vllm-0.34.0-py3-none-any.whl").is_file()
    assert (lab_dir / "model-source/ERNIE-4.5-0.3B-PT/config.json").is_file()
    assert Path(lab_state.key).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("host", [h.name for h in SPEC.hosts])
def test_strict_ssh_login_as_root_and_deploy(lab_state: LabState, host: str) -> None:
    address = lab_state.host(host).address
    root = strict_ssh(lab_state, address, "hostname; id -un")
    assert root.returncode == 0, root.stderr
    assert root.stdout.split() == [host, "root"]
    deploy = strict_ssh(lab_state, address, "sudo -n id -un", user="deploy")
    assert deploy.returncode == 0, deploy.stderr
    assert deploy.stdout.strip() == "root"


def test_wrong_or_missing_host_key_is_refused(lab_state: LabState, tmp_path: Path) -> None:
    lines = Path(lab_state.known_hosts).read_text().splitlines()
    key_of = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"127.0.0.11 {key_of['127.0.0.12']}\n")  # a10-2's key claimed for a10-1's address
    refused = strict_ssh(lab_state, "127.0.0.11", "true", known_hosts=str(wrong))
    assert refused.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in refused.stderr or "verification failed" in refused.stderr
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    unknown = strict_ssh(lab_state, "127.0.0.11", "true", known_hosts=str(empty))
    assert unknown.returncode == 255
    assert "Host key verification failed" in unknown.stderr


def test_every_host_has_its_own_host_key(lab_state: LabState) -> None:
    keys = [line.split()[2] for line in Path(lab_state.known_hosts).read_text().splitlines()]
    assert len(keys) == len(SPEC.hosts) + len(SPEC.balancers) == len(set(keys))


@pytest.mark.parametrize("host", [h.name for h in SPEC.hosts])
def test_nvidia_smi_matches_the_spec(lab: Lab, host: str) -> None:
    spec = SPEC.host(host)
    done = lab.ssh(host, "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{spec.gpu_model}, {spec.gpu_memory_mib} MiB"] * spec.gpu_count


@pytest.mark.parametrize("host", [h.name for h in SPEC.hosts])
def test_host_files_for_deploy_code(lab: Lab, host: str) -> None:
    spec = SPEC.host(host)
    gpus = lab.ssh(host, "cat /etc/ernie-lab/gpus.json")
    assert json.loads(gpus.stdout) == spec.gpus_json()
    model = lab.ssh(host, "cat /models/ERNIE-4.5-0.3B-PT/config.json")
    assert json.loads(model.stdout) == json.loads(MODEL_CONFIG.read_text())
    # vLLM is the simulator installed as a `vllm` package in its venv (pip's console script and metadata);
    # nvidia-smi is a driver tool that runs the simulator package with `python3 -m`.
    entry = lab.ssh(host, "head -n 1 /opt/vllm/0.34.0/bin/vllm; cat /usr/bin/nvidia-smi")
    assert entry.stdout.startswith("#!/opt/vllm/0.34.0/bin/python3\n")
    assert "python3 -m ernie_lab_sim.nvidia_smi" in entry.stdout
    version = lab.ssh(host, "/opt/vllm/0.34.0/bin/vllm --version; /opt/vllm/0.34.0/bin/python -c "
                            "'import importlib.metadata as m; print(m.version(\"vllm\"))'")
    assert version.returncode == 0 and version.stdout.split() == ["0.34.0", "0.34.0"], version.stdout + version.stderr
    probe = "/run/ernie-lab/gpu/.probe"
    writable = lab.ssh(host, f"runuser -u vllm -- sh -c 'touch {probe} && rm {probe}'")
    assert writable.returncode == 0, writable.stderr
    users = lab.ssh(host, "id -u vllm && getent passwd vllm | cut -d: -f7")
    assert users.returncode == 0 and users.stdout.split()[1] == "/usr/sbin/nologin"


def test_sshd_listens_only_on_the_hosts_own_address(lab: Lab, lab_state: LabState) -> None:
    for h in lab_state.hosts:
        listening = lab.ssh(h.name, "ss -Hltn 'sport = :22' | awk '{print $4}' | sort -u")
        # Hosts share the machine's network, so every lab sshd is visible; exactly one per lab address.
        assert f"{h.address}:22" in listening.stdout.split()
        assert "0.0.0.0:22" not in listening.stdout.split()


def test_systemd_is_healthy_on_every_host(lab: Lab, lab_state: LabState) -> None:
    for h in lab_state.hosts:
        done = lab.ssh(h.name, "systemctl is-system-running --wait; systemctl --failed --no-legend")
        assert done.stdout.strip() == "running", done.stdout


def test_up_again_is_a_no_op(lab: Lab, lab_state: LabState) -> None:
    again = lab.up(load_spec())
    assert [h.pid for h in again.hosts] == [h.pid for h in lab_state.hosts]
