import json
from pathlib import Path

import pytest

from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.hardware import load_catalog
from ernie_deploy.planning.models import bundled_model, derive_max_len, load_model

FIXTURES = Path(__file__).parent / "fixtures"


def test_ernie_03b_facts_match_the_reference() -> None:
    m = bundled_model("/models/ERNIE-4.5-0.3B-PT")
    assert m is not None
    assert (m.architecture, m.num_attention_heads, m.num_kv_heads, m.head_dim) == ("Ernie4_5ForCausalLM", 16, 2, 128)
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.num_experts) == (18, 1024, 103424, 0)
    assert not m.is_moe
    assert m.param_count == 360_748_032  # docs/vllm-facts.md#dense-model
    assert m.weight_bytes == 2 * 360_748_032
    assert (m.derived_max_len, m.max_len_key, m.dtype) == (131072, "max_position_embeddings", "bfloat16")
    assert m.valid_tp_sizes() == [1, 2, 4, 8, 16]
    assert m.valid_tp_sizes(limit=4) == [1, 2, 4]


def test_ernie_21b_is_moe_with_64_experts() -> None:
    m = bundled_model("baidu/ERNIE-4.5-21B-A3B-PT")
    assert m is not None and m.is_moe and m.num_experts == 64
    assert m.architecture == "Ernie4_5_MoeForCausalLM"
    assert 21.7e9 < m.param_count < 21.9e9  # docs/vllm-facts.md#moe-model: ~21.8 B
    assert m.valid_tp_sizes() == [1, 2, 4, 5, 10, 20]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 4096, "seq_length": 2048}, (2048, "seq_length")),
        ({"max_position_embeddings": 4096, "model_max_length": 8192}, (8192, "model_max_length")),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, (16384, None)),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, (4096, None)),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, (4096, None)),
        ({}, (2048, "default")),
    ],
)
def test_derived_max_len_follows_vllm_rules(config: dict, expected: tuple) -> None:
    length, key, _ = derive_max_len(config)
    assert length == expected[0]
    if expected[1]:
        assert key == expected[1]


def test_experts_are_found_under_every_key() -> None:
    base = json.loads((Path(bundled_model("ERNIE-4.5-0.3B-PT").source)).read_text())  # type: ignore[union-attr]
    for key in ("moe_num_experts", "num_experts", "n_routed_experts", "num_local_experts"):
        from ernie_deploy.planning.models import spec_from_config

        assert spec_from_config({**base, key: 8}, "x", "x").num_experts == 8


def test_local_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((FIXTURES / "models/ernie-0.3b-pre-rename.json").read_text())
    m = load_model(tmp_path)
    assert m.architecture == "Ernie4_5_ForCausalLM" and m.name == tmp_path.name


def test_malformed_config_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "hidden_size": 1024,\n  oops\n}')
    with pytest.raises(ConfigError) as err:
        load_model(bad)
    assert f"{bad}:3" in str(err.value)


def test_missing_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["X"], "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model(cfg)


def test_catalog_uses_nvidia_smi_names_and_aliases() -> None:
    c = load_catalog()
    assert c.lookup("NVIDIA A10").memory_mib == 23028  # type: ignore[union-attr]
    assert c.lookup("a10") is c.lookup("NVIDIA A10")
    assert c.lookup("NVIDIA A100-SXM4-80GB").nvlink is True  # type: ignore[union-attr]
    assert c.lookup("NVIDIA A100 80GB PCIe").nvlink is False  # type: ignore[union-attr]
    assert c.lookup("NVIDIA A100-PCIE-40GB").memory_mib == 40960  # type: ignore[union-attr]
    for name in ("NVIDIA A10G", "NVIDIA L4", "NVIDIA L40S", "NVIDIA H100 80GB HBM3", "NVIDIA H200",
                 "NVIDIA A100-SXM4-40GB"):
        assert c.lookup(name) is not None, name
    assert c.lookup("NVIDIA T4") is None
