"""Planner behaviour: table matching, overrides, instances, and validation that agrees with vLLM."""

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, codes

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan

Plan = Callable[..., HostPlan]
A10 = {"gpu_model": "NVIDIA A10"}


def finding(plan: HostPlan, code: str):  # type: ignore[no-untyped-def]
    (f,) = [f for f in plan.findings if f.code == code]
    return f


@pytest.mark.parametrize(
    ("gpu", "count", "row", "tp", "mml", "profile"),
    [("NVIDIA A10", 1, "1xA10", 1, 4096, "dev"), ("NVIDIA A10", 2, "2xA10", 2, 4096, "dev"),
     ("A10", 4, "4xA10", 4, 8192, "long-doc"), ("NVIDIA A100-SXM4-80GB", 2, "2xA100-80GB", 2, 8192, "long-doc"),
     ("NVIDIA A100 80GB PCIe", 2, "2xA100-80GB", 2, 8192, "long-doc")],
)
def test_guide_rows_are_matched(plan_one: Plan, gpu: str, count: int, row: str, tp: int, mml: int,
                                profile: str) -> None:
    p = plan_one(gpu_model=gpu, gpu_count=count)
    assert p.ok, p.findings
    assert (p.row, p.profile) == (row, profile)
    (inst,) = p.instances
    assert (inst.tensor_parallel_size, inst.max_model_len, inst.gpus) == (tp, mml, tuple(range(count)))
    assert p.settings["tensor_parallel_size"].source == f"row {row}"


def test_long_doc_profile_adds_prefix_caching(plan_one: Plan) -> None:
    assert "--enable-prefix-caching" in plan_one(**A10, gpu_count=4).instances[0].args
    assert "--enable-prefix-caching" not in plan_one(**A10, gpu_count=2).instances[0].args


def test_chosen_profile_context_beats_the_rows(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=2, vllm_profile="high-qps-api")
    assert p.instances[0].max_model_len == 2048
    assert p.settings["max_model_len"].source == "profile high-qps-api (chosen by vllm_profile)"
    p = plan_one(**A10, gpu_count=2, vllm_profile="high-qps-api", vllm_max_model_len=3000)
    assert p.instances[0].max_model_len == 3000
    assert p.settings["max_model_len"].source == "inventory variable"


def test_every_setting_can_be_overridden(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=2, vllm_port=9000, vllm_gpu_memory_utilization=0.8, vllm_bin="/usr/bin/vllm",
                 vllm_served_model_name="ernie", vllm_version="0.11.0", vllm_extra_args=["--enforce-eager"],
                 vllm_model="/srv/models/ERNIE-4.5-0.3B-PT", vllm_tensor_parallel_size=1)
    (inst,) = p.instances
    assert (inst.port, inst.gpu_memory_utilization, inst.served_model_name) == (9000, 0.8, "ernie")
    assert (p.bin, p.version, p.model_path, inst.tensor_parallel_size) == (
        "/usr/bin/vllm", "0.11.0", "/srv/models/ERNIE-4.5-0.3B-PT", 1)
    assert inst.args == ("--enforce-eager",)


def test_unknown_vllm_variable_is_an_error_with_suggestion(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=1, vllm_tensor_paralel_size=2)
    f = finding(p, "input")
    assert "vllm_tensor_paralel_size" in f.message and f.fix == "did you mean vllm_tensor_parallel_size?"


def test_wrong_type_is_an_error(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=1, vllm_max_model_len="4k"), "input")
    assert "vllm_max_model_len must be int" in f.message


def test_unmatched_hardware_lists_known_rows(plan_one: Plan) -> None:
    f = finding(plan_one(gpu_model="NVIDIA L4", gpu_count=3), "input")
    assert "no row of the recommendation table matches 3 × NVIDIA L4" in f.message
    assert "1xA10" in f.fix and "2xA100-80GB" in f.fix and "vllm_allow_fallback" in f.fix


def test_fallback_takes_largest_valid_tp_and_profile_context(plan_one: Plan) -> None:
    p = plan_one(gpu_model="NVIDIA L4", gpu_count=3, vllm_allow_fallback=True)
    assert p.ok
    (inst,) = p.instances
    assert inst.tensor_parallel_size == 2  # 3 GPUs, 16 heads: 1 and 2 are valid
    assert inst.max_model_len == 4096  # the default profile (dev)
    assert p.settings["tensor_parallel_size"].source == "computed fallback (no table row)"


def test_unknown_gpu_lists_catalog(plan_one: Plan) -> None:
    f = finding(plan_one(gpu_model="NVIDIA T4", gpu_count=1), "input")
    assert "unknown GPU model" in f.message and "NVIDIA A10" in f.fix


# The guide's three broken combinations (guide §5.1): each gets a finding whose fix is computed and true.

def test_guide_combo_1_8192_tp1_one_a10_fits(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=1, vllm_max_model_len=8192)
    assert p.ok  # the guide says OOM; for this 0.36 B model the KV cache of one sequence is 0.14 GiB
    f = finding(p, "kv-headroom")
    assert "one 8192-token sequence needs 0.14 GiB" in f.message
    assert "largest max_model_len that fits is 131072" in f.message


def test_guide_combo_2_tp4_2048_gets_true_advice(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=4, vllm_max_model_len=2048)
    assert p.ok
    assert codes(p)["tp-pcie"] == "advice" and codes(p)["tp-small-model"] == "advice"
    assert "more than two PCIe-only GPUs" in (finding(p, "tp-pcie").vllm_message or "")
    # The suggested layout must itself plan cleanly.
    fixed = plan_one(**A10, gpu_count=4, vllm_max_model_len=2048, vllm_tensor_parallel_size=1, vllm_instances=4)
    assert fixed.ok and len(fixed.instances) == 4
    assert "tp-small-model" not in codes(fixed) and "tp-pcie" not in codes(fixed)
    assert "vllm_instances: 4" in (finding(p, "tp-small-model").fix or "")


def test_guide_combo_3_tp3_fails_like_vllm(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=4, vllm_tensor_parallel_size=3)
    f = finding(p, "tp-heads")
    assert f.severity is Severity.ERROR
    assert f.vllm_message == "Total number of attention heads (16) must be divisible by tensor parallel size (3)."
    assert "set vllm_tensor_parallel_size to 4" in (f.fix or "") and "1, 2, 4" in (f.fix or "")
    assert plan_one(**A10, gpu_count=4, vllm_tensor_parallel_size=4).ok


def test_max_model_len_above_derived(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=1, vllm_max_model_len=200000), "max-model-len")
    assert f.vllm_message == (
        "User-specified max_model_len (200000) is greater than the derived max_model_len "
        "(max_position_embeddings=131072.0 or model_max_length=None in model's config.json).")
    f = finding(plan_one(**A10, gpu_count=1, vllm_max_model_len=200000, vllm_version="0.11.0"), "max-model-len")
    assert "max_position_embeddings=131072 or" in (f.vllm_message or "")
    assert "131072 or less" in (f.fix or "")


def test_world_size_above_gpus(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=2, vllm_tensor_parallel_size=4), "world-size")
    assert (f.vllm_message or "").startswith(
        "World size (4) is larger than the number of available GPUs (2) in this node.")
    assert "set vllm_tensor_parallel_size to 2" in (f.fix or "")


def test_kv_too_small_states_largest_that_fits_and_that_is_true(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=1, vllm_max_model_len=131072, vllm_gpu_memory_utilization=0.1)
    f = finding(p, "kv-too-small")
    assert (f.vllm_message or "").startswith("To serve at least one request with the model's max seq len (131072)")
    assert "which is larger than the available KV cache memory" in (f.vllm_message or "")
    largest = int((f.fix or "").split("set vllm_max_model_len to ")[1].split()[0])
    assert plan_one(**A10, gpu_count=1, vllm_max_model_len=largest, vllm_gpu_memory_utilization=0.1).ok
    old = finding(plan_one(**A10, gpu_count=1, vllm_max_model_len=131072, vllm_gpu_memory_utilization=0.1,
                           vllm_version="0.11.0"), "kv-too-small")
    assert "the models's max seq len" in (old.vllm_message or "")  # vLLM's own typo before 0.27


def test_moe_21b_does_not_fit_one_a10(plan_one: Plan) -> None:
    """Real vLLM fails while loading the weights (CUDA out of memory), not at the KV cache; the fix is the
    smallest TP that fits and the GPUs it takes, not "raise TP" on a 1-GPU host."""
    p = plan_one(**A10, gpu_count=1, vllm_model="baidu/ERNIE-4.5-21B-A3B-PT")
    assert codes(p)["weights-exceed-gpu"] == "error" and "kv-no-memory" not in codes(p)
    (f,) = [f for f in p.errors if f.code == "weights-exceed-gpu"]
    assert "CUDA out of memory" in (f.vllm_message or "")
    assert re.search(r"set vllm_tensor_parallel_size to (\d+), the smallest that fits: \1 × NVIDIA A10 per "
                     r"instance \(this host has 1\)", f.fix or ""), f.fix


def test_instances_get_own_gpus_ports_units_names(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=4, vllm_instances=2, vllm_tensor_parallel_size=2)
    assert p.ok
    a, b = p.instances
    assert (a.gpus, b.gpus) == ((0, 1), (2, 3))
    assert (a.port, b.port) == (8000, 8001)
    assert (a.unit, b.unit) == ("ernie-vllm-0", "ernie-vllm-1")
    # Replicas serve one name by default (one load balancer in front); the suffix is opt-in.
    assert (a.served_model_name, b.served_model_name) == ("ERNIE-4.5-0.3B-PT", "ERNIE-4.5-0.3B-PT")
    suffixed = plan_one(**A10, gpu_count=4, vllm_instances=2, vllm_tensor_parallel_size=2,
                        vllm_served_model_name_suffix=True)
    assert [i.served_model_name for i in suffixed.instances] == ["ERNIE-4.5-0.3B-PT", "ERNIE-4.5-0.3B-PT-1"]


def test_instances_never_share_gpus_unless_asked(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=2, vllm_instances=2, vllm_tensor_parallel_size=2)
    assert codes(p)["gpus-exhausted"] == "error"
    shared = plan_one(**A10, gpu_count=2, vllm_instances=2, vllm_tensor_parallel_size=2, vllm_share_gpus=True)
    f = finding(shared, "gpu-shared-overcommit")
    assert "Free memory on device cuda:0 (" in (f.vllm_message or "")
    assert "0.50 or less" in (f.fix or "")
    ok = plan_one(**A10, gpu_count=2, vllm_instances=2, vllm_tensor_parallel_size=2, vllm_share_gpus=True,
                  vllm_gpu_memory_utilization=0.45)
    assert ok.ok and ok.instances[0].gpus == ok.instances[1].gpus == (0, 1)


def test_expert_parallel_on_dense_model(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=2, vllm_extra_args=["--enable-expert-parallel"]), "ep-dense")
    assert f.vllm_message == ("Number of experts in the model must be greater than 0 when expert parallelism "
                              "is enabled.")


def test_moe_tp_above_experts(plan_one: Plan, tmp_path: Path) -> None:
    import json

    cfg = json.loads((ROOT / "ernie_deploy/data/models/ERNIE-4.5-21B-A3B-PT/config.json").read_text())
    cfg.update(moe_num_experts=4, num_attention_heads=16, num_key_value_heads=4, hidden_size=2048)
    (tmp_path / "moe.json").write_text(json.dumps(cfg))
    p = plan_one(gpu_model="NVIDIA A100-SXM4-80GB", gpu_count=8, vllm_allow_fallback=True, vllm_tensor_parallel_size=8,
                 vllm_model_config=str(tmp_path / "moe.json"))
    assert finding(p, "moe-tp-experts").vllm_message == (
        "Tensor parallel size 8 is greater than the number of experts 4.")


def test_architecture_rename(plan_one: Plan) -> None:
    old = str(FIXTURES / "models/ernie-0.3b-pre-rename.json")
    f = finding(plan_one(**A10, gpu_count=1, vllm_model_config=old), "architecture")
    assert f.vllm_message is not None and f.vllm_message.startswith(
        "Model architectures ['Ernie4_5_ForCausalLM'] are not supported for now.")
    assert '"architectures": ["Ernie4_5ForCausalLM"]' in (f.fix or "")
    assert plan_one(**A10, gpu_count=1, vllm_model_config=old, vllm_version="0.9.2").ok
    new_on_old = plan_one(**A10, gpu_count=1, vllm_version="0.9.2")
    assert codes(new_on_old)["architecture"] == "error"
    assert codes(plan_one(**A10, gpu_count=1, vllm_version="0.10.0"))["architecture-unknown"] == "warning"


@pytest.mark.parametrize(("version", "expected"), [("0.11.0", None), ("0.15.0", "warning"), ("0.34.0", "error")])
def test_removed_flags_by_version(plan_one: Plan, version: str, expected: str | None) -> None:
    p = plan_one(**A10, gpu_count=1, vllm_version=version, vllm_extra_args=["--swap-space", "4"])
    got = {f.severity.value for f in p.findings if f.code in ("removed-flag", "flag-unknown")}
    assert got == ({expected} if expected else set())
    if expected == "error":
        assert finding(p, "removed-flag").vllm_message == "vllm serve: error: unrecognized arguments: --swap-space"


def test_managed_flags_in_extra_args_are_refused(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=1, vllm_extra_args=["--api-key=abc"]), "managed-flag")
    assert "vllm_api_key" in (f.fix or "")


def test_one_bad_host_does_not_hide_the_others() -> None:
    inventory = load_inventory(ROOT / "inventory/example.yml")
    plans = {p.name: p for p in plan_hosts(list(inventory.select(None)), PlanContext.load())}
    assert [n for n, p in plans.items() if not p.ok] == ["gpu-a10-05.dc1"]
    assert {p.row for p in plans.values()} == {"1xA10", "2xA10", "4xA10", "2xA100-80GB"}


def test_custom_table_file(tmp_path: Path, write_inventory: Callable[[str], Path]) -> None:
    table = tmp_path / "table.yml"
    table.write_text("""
profiles:
  dev: {max_model_len: 1024}
rows:
  - {name: tiny, gpu_model: L4, gpu_count: 1, tensor_parallel_size: 1, gpu_memory_utilization: 0.5}
""")
    inv = write_inventory("all:\n  hosts:\n    h: {gpu_model: NVIDIA L4, gpu_count: 1}\n")
    (p,) = plan_hosts(list(load_inventory(inv).select(None)), PlanContext.load(table))
    assert p.ok and p.row == "tiny"
    assert (p.instances[0].max_model_len, p.instances[0].gpu_memory_utilization) == (1024, 0.5)


def test_bad_table_names_key(tmp_path: Path) -> None:
    from ernie_deploy.errors import ConfigError

    table = tmp_path / "table.yml"
    table.write_text("profiles: {}\nrows:\n  - {name: x, gpu_model: NVIDIA T4, gpu_count: 1}\n")
    with pytest.raises(ConfigError, match=r"rows\[0\]\.gpu_model: unknown GPU 'NVIDIA T4'"):
        PlanContext.load(table)
    table.write_text("rows:\n  - {name: x, gpu_model: A10, gpu_count: one}\n")
    with pytest.raises(ConfigError, match=r"rows\[0\]\.gpu_count: expected int"):
        PlanContext.load(table)
