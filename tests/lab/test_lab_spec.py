"""The lab's pure parts (spec validation, mirror discovery, inventory, CLI wiring): no root, no containers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ernie_deploy.cli import lab as cli
from ernie_deploy.errors import DeployError
from ernie_deploy.lab import BalancerStatus, HostState, LabState, access, rootfs
from ernie_deploy.lab.lab import HostStatus
from ernie_deploy.lab.spec import DEFAULT_SPEC, BalancerSpec, gpu_uuid, load_spec, parse_spec
from ernie_deploy.lab.state import load_state
from ernie_deploy.output.lab import show_status, show_up


def test_default_spec_is_the_guides_hardware_table() -> None:
    spec = load_spec()
    assert [(h.name, h.address, h.gpu_model, h.gpu_count, h.nvlink) for h in spec.hosts] == [
        ("a10-1", "127.0.0.11", "NVIDIA A10", 1, False),
        ("a10-2", "127.0.0.12", "NVIDIA A10", 2, False),
        ("a10-4", "127.0.0.13", "NVIDIA A10", 4, False),
        ("a100-2", "127.0.0.14", "NVIDIA A100-SXM4-80GB", 2, True),
    ]
    # HAProxy in front of them, on the next address; kept apart so code walking GPU hosts never meets it.
    assert spec.balancers == (BalancerSpec("lb-1", "127.0.0.15"),)


def test_real_vllm_spec_has_its_balancer_and_the_two_labs_never_share_an_address() -> None:
    real = load_spec(DEFAULT_SPEC.with_name("lab-real-vllm.yml"))
    assert [(b.name, b.address) for b in real.balancers] == [("lb-real", "127.0.0.43")]
    default = load_spec()
    addresses = [{h.address for h in (*s.hosts, *s.balancers)} for s in (default, real)]
    assert not addresses[0] & addresses[1]


def test_balancers_take_addresses_in_spec_order_and_no_gpu_defaults() -> None:
    spec = parse_spec({
        "first_address": "127.0.1.1",
        "defaults": {"gpu_model": "NVIDIA A10G", "gpu_count": 2},
        "hosts": [{"name": "lb", "role": "balancer"}, {"name": "gpu", "count": 2},
                  {"name": "edge", "role": "balancer", "count": 2}, {"name": "last", "role": "gpu"}],
    })
    assert [(h.name, h.address, h.gpu_count) for h in spec.hosts] == [
        ("gpu-1", "127.0.1.2", 2), ("gpu-2", "127.0.1.3", 2), ("last", "127.0.1.6", 2)]
    assert spec.balancers == (BalancerSpec("lb", "127.0.1.1"), BalancerSpec("edge-1", "127.0.1.4"),
                              BalancerSpec("edge-2", "127.0.1.5"))
    assert spec.all_bare().balancers == spec.balancers
    with pytest.raises(KeyError):
        spec.host("lb")  # a GPU host lookup


@pytest.mark.parametrize("key", ["gpu_model", "gpu_count", "gpu_memory_mib", "nvlink", "vllm_version", "faults",
                                 "driver_version", "cuda_version", "bare", "vllm"])
def test_gpu_and_vllm_keys_on_a_balancer_are_refused(key: str) -> None:
    with pytest.raises(DeployError) as info:
        parse_spec({"hosts": [{"name": "a"}, {"name": "lb", "role": "balancer", key: 1}]}, source="my-lab.yml")
    assert info.value.where == f"my-lab.yml: hosts[1].{key}"
    assert "a balancer host has no GPUs and runs no vLLM" in info.value.message
    assert info.value.hint == f"drop {key}, or drop role: balancer to make it a GPU host"


def test_gpus_json_shape() -> None:
    host = load_spec().host("a100-2")
    assert host.gpus_json() == {
        "driver_version": "580.95.05",
        "cuda_version": "13.0",
        "nvlink": True,
        "gpus": [
            {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "uuid": gpu_uuid("a100-2", 0),
             "memory_total_mib": 81920, "pci_bus_id": "00000000:00:1D.0"},
            {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "uuid": gpu_uuid("a100-2", 1),
             "memory_total_mib": 81920, "pci_bus_id": "00000000:00:1E.0"},
        ],
    }
    assert gpu_uuid("a100-2", 0) == gpu_uuid("a100-2", 0) != gpu_uuid("a100-2", 1)
    assert gpu_uuid("a10-1", 0).startswith("GPU-")


def test_count_replicates_hosts_and_defaults_apply() -> None:
    spec = parse_spec({
        "first_address": "127.0.1.1",
        "defaults": {"gpu_model": "NVIDIA A10G", "vllm_version": "0.11.0"},
        "hosts": [{"name": "node", "count": 16, "gpu_count": 2, "faults": {"health_503": True}},
                  {"name": "big", "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559}],
    })
    assert len(spec.hosts) == 17
    assert spec.hosts[0].name == "node-1" and spec.hosts[15].name == "node-16"
    assert spec.hosts[15].address == "127.0.1.16" and spec.hosts[16].address == "127.0.1.17"
    assert {h.gpu_memory_mib for h in spec.hosts[:16]} == {23028}
    assert spec.hosts[0].vllm_version == "0.11.0" and spec.hosts[0].faults == {"health_503": True}
    assert spec.host("big").gpu_memory_mib == 81559


@pytest.mark.parametrize(("data", "where", "words"), [
    ({"hosts": [{"name": "a", "gpu_model": "NVIDIA T4"}]}, "hosts[0].gpu_model", "unknown GPU model"),
    ({"hosts": [{"name": "a", "gpu_count": "two"}]}, "hosts[0].gpu_count", "integer"),
    ({"hosts": [{"name": "A_1"}]}, "hosts[0].name", "not a valid host name"),
    ({"hosts": [{"name": "a"}, {"name": "a"}]}, "hosts", "duplicate host name"),
    ({"hosts": [{"name": "a", "gpus": 2}]}, "hosts[0].gpus", "unknown key"),
    ({"hosts": [{"name": "a", "vllm_version": 0.11}]}, "hosts[0].vllm_version", "not a version string"),
    ({"hosts": [{"name": "a", "faults": ["x"]}]}, "hosts[0].faults", "must be a mapping"),
    ({"hosts": []}, "hosts", "non-empty list"),
    ({"first_address": "127.0.0.1", "hosts": [{"name": "a"}]}, "first_address", "above 127.0.0.1"),
    ({"first_address": "10.0.0.5", "hosts": [{"name": "a"}]}, "first_address", "127.0.0.0/8"),
    ({"hostz": []}, "hostz", "unknown key"),
    ({"hosts": [{"name": "a", "role": "router"}]}, "hosts[0].role", "neither gpu nor balancer"),
    ({"hosts": [{"name": "lb", "role": "balancer", "port": 8080}]}, "hosts[0].port", "unknown key"),
    ({"hosts": [{"name": "lb", "role": "balancer"}]}, "hosts", "at least one GPU host"),
    ({"hosts": [{"name": "a"}, {"name": "a", "role": "balancer"}]}, "hosts", "duplicate host name"),
    ({"hosts": [{"name": "A", "role": "balancer"}]}, "hosts[0].name", "not a valid host name"),
])
def test_bad_specs_name_file_and_key(data: object, where: str, words: str) -> None:
    with pytest.raises(DeployError) as info:
        parse_spec(data, source="my-lab.yml")
    assert info.value.where == f"my-lab.yml: {where}"
    assert words in info.value.message


def test_spec_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="cannot read lab spec"):
        load_spec(tmp_path / "missing.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("hosts: [\n")
    with pytest.raises(DeployError, match="not valid YAML"):
        load_spec(bad)


def test_mirror_from_deb822_and_one_line_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ERNIE_LAB_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
        "Types: deb deb-src\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n")
    assert rootfs.find_mirror(apt_dir=tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list").write_text(
        "# x\ndeb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n")
    assert rootfs.find_mirror(apt_dir=tmp_path) == "http://one.example/debian"
    disabled = tmp_path / "none"
    (disabled / "sources.list.d").mkdir(parents=True)
    (disabled / "sources.list.d" / "x.sources").write_text(
        "Enabled: no\nTypes: deb\nURIs: http://off.example/debian\nSuites: bookworm\n")
    with pytest.raises(DeployError, match="no apt source for Debian bookworm"):
        rootfs.find_mirror(apt_dir=disabled)
    monkeypatch.setenv("ERNIE_LAB_MIRROR", "http://override.example/debian")
    assert rootfs.find_mirror(apt_dir=disabled) == "http://override.example/debian"


def test_cache_key_follows_its_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    base = rootfs.cache_key()
    assert rootfs.cache_key(packages=(*rootfs.PACKAGES, "curl")) != base
    assert rootfs.cache_key(suite="trixie") != base
    assert rootfs.cache_key(arch="arm64") != base or rootfs.debian_arch() == "arm64"
    monkeypatch.setenv("ERNIE_LAB_CACHE", str(tmp_path))
    assert rootfs.rootfs_path().parent == tmp_path
    assert rootfs.rootfs_path().name.endswith(base)


def test_inventory_shape(tmp_path: Path) -> None:
    spec = load_spec()
    data = access.inventory(spec.hosts, tmp_path / "id_ed25519", tmp_path / "known_hosts", tmp_path / "wheels",
                            tmp_path / "model")
    lab = data["all"]["children"]["lab"]
    assert lab["hosts"]["a10-4"] == {"ansible_host": "127.0.0.13", "gpu_model": "NVIDIA A10", "gpu_count": 4,
                                  "vllm_host": "127.0.0.13", "vllm_version": "0.34.0"}
    assert lab["vars"]["vllm_pip_find_links"] == str(tmp_path / "wheels")
    assert lab["vars"]["vllm_model_source"] == str(tmp_path / "model")
    assert "vllm_bin" not in lab["vars"]
    assert lab["vars"]["ansible_ssh_private_key_file"] == str(tmp_path / "id_ed25519")
    assert lab["vars"]["ernie_known_hosts"] == str(tmp_path / "known_hosts")
    assert lab["vars"]["vllm_stable_seconds"] == 2  # short windows for a simulator that loads in seconds


def test_inventory_has_the_balancer_group(tmp_path: Path) -> None:
    spec = load_spec()
    data = access.inventory(spec.hosts, tmp_path / "id_ed25519", tmp_path / "known_hosts", tmp_path / "wheels",
                            tmp_path / "model", balancers=spec.balancers)
    groups = data["all"]["children"]
    assert set(groups) == {"lab", "vllm_balancers"}
    assert groups["vllm_balancers"] == {
        "hosts": {"lb-1": {"ansible_host": "127.0.0.15", "vllm_balancer_bind": "127.0.0.15"}},
        "vars": {"ansible_user": "root", "ansible_port": 22,
                 "ansible_ssh_private_key_file": str(tmp_path / "id_ed25519"),
                 "ernie_known_hosts": str(tmp_path / "known_hosts"),
                 "vllm_balancer_port": 8080, "vllm_balancer_check_interval": 1},
    }
    assert "lb-1" not in groups["lab"]["hosts"]
    without = access.inventory(spec.hosts, tmp_path / "k", tmp_path / "kh", tmp_path / "w", tmp_path / "m")
    assert set(without["all"]["children"]) == {"lab"}


def test_rootfs_has_haproxy_for_balancers() -> None:
    assert "haproxy" in rootfs.PACKAGES and rootfs.BALANCER_UNIT == "haproxy.service"
    assert rootfs.BALANCER_UNIT not in rootfs.MASKED_UNITS  # disabled, not masked: deploy enables it


def _lab_state(tmp_path: Path) -> LabState:
    def machine(name: str, address: str, count: int, frontend: str | None = None) -> HostState:
        return HostState(name=name, address=address, gpu_model="NVIDIA A10" if count else "", gpu_count=count,
                         gpus=[], machine_dir=str(tmp_path / name), mode="overlay", pid=7, frontend=frontend)
    return LabState(dir=str(tmp_path), spec_source="spec.yml", spec_hosts=[], rootfs="/r", key="/k",
                    known_hosts="/kh", inventory=str(tmp_path / "inventory.yml"),
                    hosts=[machine("a10-1", "127.0.0.11", 1)], balancers=[machine("lb-1", "127.0.0.15", 0, "http://127.0.0.15:8080")])


def test_lab_state_keeps_balancers_apart_and_survives_a_reload(tmp_path: Path) -> None:
    state = _lab_state(tmp_path)
    state.save()
    again = load_state(tmp_path)
    assert again == state and [h.name for h in again.hosts] == ["a10-1"]
    assert [h.name for h in again.machines] == ["a10-1", "lb-1"] and again.host("lb-1").frontend
    with pytest.raises(DeployError) as info:
        again.host("lb-2")
    assert info.value.hint == "lab hosts: a10-1, lb-1"
    # A state file written before balancers existed still loads.
    data = json.loads((tmp_path / "state.json").read_text())
    del data["balancers"]
    (tmp_path / "state.json").write_text(json.dumps(data))
    old = load_state(tmp_path)
    assert old is not None and old.balancers == []


def test_up_and_status_name_the_balancer_and_its_frontend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _lab_state(tmp_path)
    show_up(state, json=False)
    out = capsys.readouterr().out
    assert "lb-1" in out and "http://127.0.0.15:8080" in out and "vllm_balancers" in out
    show_up(state, json=True)
    assert json.loads(capsys.readouterr().out)["balancers"] == [
        {"name": "lb-1", "address": "127.0.0.15", "pid": 7, "frontend": "http://127.0.0.15:8080"}]
    hosts = [HostStatus("a10-1", "127.0.0.11", "ssh-ready", 7, "NVIDIA A10", 1)]
    balancers = [BalancerStatus("lb-1", "127.0.0.15", "ssh-ready", 8, "http://127.0.0.15:8080")]
    show_status(tmp_path, hosts, json=False, balancers=balancers)
    out = capsys.readouterr().out
    assert "lb-1" in out and "http://127.0.0.15:8080" in out
    show_status(tmp_path, hosts, json=True, balancers=balancers)
    doc = json.loads(capsys.readouterr().out)
    assert [h["name"] for h in doc["hosts"]] == ["a10-1"]
    assert doc["balancers"] == [{"name": "lb-1", "address": "127.0.0.15", "state": "ssh-ready", "pid": 8,
                                 "frontend": "http://127.0.0.15:8080"}]


def test_cli_registers_lab_subcommands() -> None:
    parser = argparse.ArgumentParser(prog="ernie-deploy")
    cli.register(parser.add_subparsers(dest="command", required=True))
    up = parser.parse_args(["lab", "up", "--spec", "x.yml", "--inventory-out", "inv.yml", "--json"])
    assert (up.func, up.spec, up.inventory_out, up.json) == (cli.cmd_up, Path("x.yml"), Path("inv.yml"), True)
    assert parser.parse_args(["lab", "status", "--json"]).func is cli.cmd_status
    assert parser.parse_args(["lab", "down"]).func is cli.cmd_down
    with pytest.raises(SystemExit):
        parser.parse_args(["lab"])
