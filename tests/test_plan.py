"""Planner behaviour: table matching, overrides, instances, and validation that agrees with vLLM."""

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, codes

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan, Tuning

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


def test_tuning_holds_the_settings_a_rollout_acts_on_typed(plan_one: Plan) -> None:
    p = plan_one(**A10, gpu_count=2)
    assert p.tuning == Tuning(startup_budget=600.0, stable_seconds=10.0, keep_releases=5, share_gpus=False,
                              extra_args=())
    p = plan_one(**A10, gpu_count=2, vllm_startup_budget=90, vllm_stable_seconds=2.5, vllm_keep_releases=2,
                 vllm_extra_args=["--enforce-eager"])
    assert p.tuning == Tuning(90.0, 2.5, 2, False, ("--enforce-eager",))
    assert isinstance(p.tuning.startup_budget, float) and p.settings["startup_budget"].value == 90


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


# Each numeric setting, a value just outside its range and one just inside (issue 23, item 6).
BOUNDS = [
    ("vllm_port", 0, 1), ("vllm_port", 65536, 65535), ("vllm_port", 99999, 8000),
    ("vllm_gpu_memory_utilization", 0, 0.01), ("vllm_gpu_memory_utilization", 1.5, 1),
    ("vllm_gpu_memory_utilization", 1.0001, 0.9), ("vllm_gpu_memory_utilization", float("nan"), 0.5),
    ("vllm_max_model_len", 0, 1), ("vllm_max_model_len", -4096, 4096),
    ("vllm_tensor_parallel_size", 0, 1), ("vllm_pipeline_parallel_size", 0, 1), ("vllm_instances", 0, 1),
    ("vllm_drain_timeout", -1, 0), ("vllm_startup_budget", 0, 0.5), ("vllm_startup_budget", float("inf"), 600),
    ("vllm_keep_releases", 0, 1), ("vllm_stable_seconds", -0.5, 0),
    ("vllm_balancer_weight", 0, 1), ("vllm_balancer_weight", 257, 256),
]


@pytest.mark.parametrize(("var", "bad", "good"), BOUNDS)
def test_numeric_settings_out_of_range_are_input_errors_naming_key_and_fix(
        plan_one: Plan, var: str, bad: float, good: float) -> None:
    f = finding(plan_one(**A10, gpu_count=1, **{var: bad}), "input")
    assert f.message.startswith(f"{var} must be ") and f"got {bad!r}" in f.message
    assert f.fix is not None and f.fix.startswith(f"set {var} to ")
    assert not [f for f in plan_one(**A10, gpu_count=1, **{var: good}).findings if f.code == "input"]


def test_every_numeric_setting_has_bounds() -> None:
    from ernie_deploy.planning.settings import SETTING_TYPES

    numeric = {n for n, t in SETTING_TYPES.items() if t.kind in (int, (int, float))}
    # vllm_cpu_kvcache_space is checked against the CPU backend's own rule (planning/cpubackend.py).
    assert {n for n in numeric if SETTING_TYPES[n].bounds is None} == {"cpu_kvcache_space"}
    assert {v.removeprefix("vllm_") for v, _, _ in BOUNDS} == numeric - {"cpu_kvcache_space"}


def test_last_instance_port_must_exist(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=2, vllm_port=65535, vllm_instances=2, vllm_tensor_parallel_size=1), "input")
    assert "port 65536" in f.message and f.fix is not None and "set vllm_port to 65534 or lower" in f.fix


def test_every_input_problem_is_reported_at_once_with_the_closest_name(plan_one: Plan) -> None:
    p = plan_one(gpu_modle="NVIDIA A10", gpu_count=1, vllm_prot=8001, vllm_gpu_memory_utilization=1.5)
    found = {f.message: f.fix for f in p.findings if f.code == "input"}
    assert found["unknown variable gpu_modle"] == "did you mean gpu_model?"
    assert found["unknown variable vllm_prot"] == "did you mean vllm_port?"
    assert "vllm_gpu_memory_utilization must be above 0 and at most 1, got 1.5" in found
    assert "gpu_model is not set" in found
    # A variable of the operator's own that resembles nothing ernie-deploy reads is left alone.
    assert not [f for f in plan_one(**A10, gpu_count=1, hook_pool="web").findings if f.code == "input"]


def test_one_error_text_lists_every_problem() -> None:
    from ernie_deploy.planning.settings import inventory_settings

    with pytest.raises(InventoryError) as err:
        inventory_settings({"vllm_prot": 1, "vllm_gpu_modle": "x", "vllm_port": "eighty"}, "h")
    text = str(err.value)
    assert text.startswith("h: 3 problems in its variables:")
    assert "vllm_prot (fix: did you mean vllm_port?)" in text and "vllm_port must be int" in text


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


@pytest.mark.parametrize(("count", "instances", "tp"), [(4, 2, 2), (4, 1, 4), (2, 1, 2)])
def test_layout_advice_is_given_once_per_host_with_numbers_that_agree(
        plan_one: Plan, count: int, instances: int, tp: int) -> None:
    p = plan_one(**A10, gpu_count=count, vllm_max_model_len=2048, vllm_instances=instances,
                 vllm_tensor_parallel_size=tp)
    advice = [f for f in p.findings if f.severity is Severity.ADVICE]
    assert advice and len({f.code for f in advice}) == len(advice) and all(f.instance is None for f in advice)
    for f in advice:
        m = re.search(r"(\d+) replicas of TP (\d) on the same (\d+) GPUs .*vllm_instances: (\d+), "
                      r"vllm_tensor_parallel_size: (\d)", f.fix or "")
        assert m is not None, f.fix
        replicas, new_tp, gpus, suggested, suggested_tp = map(int, m.groups())
        assert replicas == suggested and new_tp == suggested_tp and gpus == instances * tp == replicas * new_tp
        following = plan_one(**A10, gpu_count=count, vllm_max_model_len=2048, vllm_instances=suggested,
                             vllm_tensor_parallel_size=suggested_tp)
        assert following.ok and f.code not in codes(following)


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


# vLLM's CPU backend (docs/variables.md#vllms-cpu-backend): the lab's real-vLLM hosts pin the CPU build.
CPU = {**A10, "gpu_count": 2, "vllm_version": "0.32.0+cpu", "vllm_max_model_len": 4096}
CPU4 = {**CPU, "gpu_count": 4, "vllm_tensor_parallel_size": 2}  # the 4xA10 row would give TP 4


def test_cpu_build_version_is_release_0_32() -> None:
    from ernie_deploy.planning.versions import Presence, parse_version, version_facts

    assert parse_version("0.32.0+cpu") == parse_version("0.32.0") == (0, 32, 0)
    facts = version_facts()
    assert facts.architectures["Ernie4_5ForCausalLM"].presence((0, 32, 0)) is Presence.PRESENT
    assert facts.architectures["Ernie4_5_ForCausalLM"].presence((0, 32, 0)) is Presence.ABSENT
    assert facts.flags["--shutdown-timeout"].presence((0, 32, 0)) is Presence.PRESENT
    assert facts.flags["--swap-space"].presence((0, 32, 0)) is Presence.ABSENT


def test_cpu_host_plans_with_its_pool_and_binding_and_no_warnings(plan_one: Plan) -> None:
    p = plan_one(**CPU, vllm_cpu_kvcache_space=1, vllm_cpu_omp_threads_bind="0|1",
                 vllm_extra_args=["--load-format", "dummy", "--enforce-eager"])
    assert p.ok and not [f for f in p.findings if f.severity is not Severity.INFO], p.findings
    (inst,) = p.instances
    assert (inst.cpu_kvcache_space, inst.cpu_omp_threads_bind) == (1, "0|1")
    assert inst.memory is not None and inst.memory.kv_tokens == 116480  # 1 GiB per rank, 1 KV head per rank at TP 2
    assert p.settings["cpu_kvcache_space"].source == "inventory variable"
    assert p.settings["cpu_omp_threads_bind"].source == "inventory variable"
    memory = p.to_json()["instances"][0]["memory"]
    assert (memory["kv_pool_source"], memory["kv_pool_bytes"], memory["kv_tokens"]) == (
        "vllm_cpu_kvcache_space", 2**30, 116480)
    headroom = finding(p, "kv-headroom")
    assert "vllm_cpu_kvcache_space (1 GiB per worker rank" in headroom.message and "116,480 tokens" in headroom.message
    assert "tp-small-model" not in codes(p)  # GPU layout advice does not apply to the CPU backend


def test_gpu_hosts_keep_the_gpu_memory_model(plan_one: Plan) -> None:
    memory = plan_one(**A10, gpu_count=1).to_json()["instances"][0]["memory"]
    assert (memory["kv_pool_source"], memory["kv_block_size"]) == ("gpu_memory_utilization", 16)


def test_cpu_settings_come_from_the_table_too(tmp_path: Path, write_inventory: Callable[[str], Path]) -> None:
    table = (ROOT / "ernie_deploy/data/recommendations.yml").read_text().replace(
        "  gpu_memory_utilization: 0.9\n", "  gpu_memory_utilization: 0.9\n  cpu_kvcache_space: 2\n", 1)
    (tmp_path / "table.yml").write_text(table)
    inv = write_inventory("all:\n  hosts:\n    h: {gpu_model: A10, gpu_count: 1, vllm_version: 0.32.0+cpu}\n")
    (p,) = plan_hosts(list(load_inventory(inv).select(None)), PlanContext.load(tmp_path / "table.yml", tmp_path))
    assert p.instances[0].cpu_kvcache_space == 2
    assert p.settings["cpu_kvcache_space"].source.startswith("table defaults")


def test_cpu_pool_too_small_for_the_context_fails_like_vllm(plan_one: Plan) -> None:
    f = finding(plan_one(**{**CPU, "vllm_max_model_len": 131072}, vllm_tensor_parallel_size=1,
                         vllm_cpu_kvcache_space=1), "kv-too-small")
    assert f.severity is Severity.ERROR and f.instance == "ernie-vllm-0"
    assert f.vllm_message is not None and f.vllm_message.startswith(
        "To serve at least one request with the model's max seq len (131072), (2.25 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (1.0 GiB).")
    assert f.fix == "set vllm_max_model_len to 58112 or less (the largest that fits), or vllm_cpu_kvcache_space to 3"


@pytest.mark.parametrize(("value", "code", "words"), [
    ("0-3", "cpu-omp-bind-ranks", "'0-3' gives 1 CPU list(s), but TP 2 × PP 1 = 2 worker rank(s) need one each"),
    ("0|1|2", "cpu-omp-bind-ranks", "'0|1|2' gives 3 CPU list(s)"),
    ("0|a", "cpu-omp-bind", "'a' is not a CPU list like 0-3,8"),
    ("0||1", "cpu-omp-bind", "an empty CPU list"),
    ("0|1|", "cpu-omp-bind", "an empty CPU list"),
    ("3-1|4", "cpu-omp-bind", "the range 3-1 runs backwards"),
    ("0, 1|2", "cpu-omp-bind", "'0, 1' is not a CPU list"),
    ("AUTO", "cpu-omp-bind", "'AUTO' is not a CPU list"),
])
def test_bad_omp_binding_is_an_error_naming_instance_value_and_fix(plan_one: Plan, value: str, code: str,
                                                                    words: str) -> None:
    p = plan_one(**CPU, vllm_cpu_kvcache_space=1, vllm_cpu_omp_threads_bind=value)
    f = finding(p, code)
    assert f.severity is Severity.ERROR and f.instance == "ernie-vllm-0"
    assert f"vllm_cpu_omp_threads_bind {value!r}" in f.message and words in f.message, f.message
    assert f.fix is not None and re.search(r"'\d+(-\d+)?\|\d+(-\d+)?'", f.fix), f.fix  # a value for two ranks


def test_rank_count_mismatch_quotes_vllm_and_splits_the_cpus(plan_one: Plan) -> None:
    f = finding(plan_one(**CPU, vllm_cpu_kvcache_space=1, vllm_cpu_omp_threads_bind="0-3"), "cpu-omp-bind-ranks")
    assert f.vllm_message == "Given number of CPU id list ['0-3'] doesn't match local world size 2."
    assert f.fix == "set vllm_cpu_omp_threads_bind to '0-1|2-3' (one CPU list per rank, joined by '|'), or to nobind"
    # pipeline parallelism adds ranks: TP 2 × PP 2 needs four lists
    f = finding(plan_one(**CPU4, vllm_pipeline_parallel_size=2, vllm_cpu_omp_threads_bind="0|1"),
                "cpu-omp-bind-ranks")
    assert "TP 2 × PP 2 = 4 worker rank(s)" in f.message and "'0|1|2|3'" in (f.fix or "")


@pytest.mark.parametrize("value", ["auto", "nobind", "0|1", "0-3,8|4-7,9", ["0|1"]])
def test_good_omp_bindings_plan(plan_one: Plan, value: object) -> None:
    p = plan_one(**CPU, vllm_cpu_kvcache_space=1, vllm_cpu_omp_threads_bind=value)
    assert p.ok and not [f for f in p.findings if f.severity is Severity.WARNING], p.findings


def test_a_list_binds_each_instance_in_order(plan_one: Plan) -> None:
    p = plan_one(**CPU4, vllm_instances=2, vllm_cpu_kvcache_space=1,
                 vllm_cpu_omp_threads_bind=["0|1", "2-3|4-5"])
    assert p.ok, p.findings
    assert [i.cpu_omp_threads_bind for i in p.instances] == ["0|1", "2-3|4-5"]


def test_a_list_of_the_wrong_length_is_an_error(plan_one: Plan) -> None:
    p = plan_one(**CPU4, vllm_instances=2, vllm_cpu_kvcache_space=1,
                 vllm_cpu_omp_threads_bind=["0|1"])
    f = finding(p, "cpu-omp-bind-count")
    assert f.severity is Severity.ERROR
    assert f.message == "vllm_cpu_omp_threads_bind lists 1 value(s) for 2 instance(s)"
    assert f.fix is not None and "ernie-vllm-0, ernie-vllm-1" in f.fix
    assert [i.cpu_omp_threads_bind for i in p.instances] == ["0|1", None]
    assert "cpu-omp-bind-auto" not in codes(p)  # the missing value is this error, not an unset binding


def test_one_string_for_several_instances_binds_them_to_the_same_cpus(plan_one: Plan) -> None:
    p = plan_one(**CPU4, vllm_instances=2, vllm_cpu_kvcache_space=1,
                 vllm_cpu_omp_threads_bind="0|1")
    assert p.ok
    f = finding(p, "cpu-omp-bind-overlap")
    assert f.severity is Severity.ADVICE and "ernie-vllm-0 and ernie-vllm-1" in f.message and "(0-1)" in f.message


def test_several_ranks_without_a_binding_warn_about_numa_nodes(plan_one: Plan) -> None:
    f = finding(plan_one(**CPU, vllm_cpu_kvcache_space=1), "cpu-omp-bind-auto")
    assert f.severity is Severity.WARNING and f.instance == "ernie-vllm-0"
    assert f.vllm_message == "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers."
    assert f.fix is not None and "'0|1'" in f.fix
    assert "cpu-omp-bind-auto" not in codes(plan_one(**CPU, vllm_tensor_parallel_size=1, vllm_cpu_kvcache_space=1))


@pytest.mark.parametrize("space", [0, -1])
def test_kvcache_space_below_one_gib_is_an_error(plan_one: Plan, space: int) -> None:
    p = plan_one(**CPU, vllm_cpu_kvcache_space=space, vllm_cpu_omp_threads_bind="0|1")
    f = finding(p, "cpu-kvcache-space")
    assert f.severity is Severity.ERROR and f"got {space}" in f.message
    assert f.vllm_message == "No available memory for the cache blocks."
    assert f.fix is not None and "vllm_cpu_kvcache_space" in f.fix
    assert p.instances[0].memory is None


@pytest.mark.parametrize(("var", "value", "words"), [
    ("vllm_cpu_kvcache_space", 1.5, "vllm_cpu_kvcache_space must be int, got float 1.5"),
    ("vllm_cpu_kvcache_space", "one", "vllm_cpu_kvcache_space must be int, got str 'one'"),
    ("vllm_cpu_omp_threads_bind", 5, "vllm_cpu_omp_threads_bind must be str or list of str, got int 5"),
    ("vllm_cpu_omp_threads_bind", ["0", 1], "vllm_cpu_omp_threads_bind must be str or list of str"),
])
def test_cpu_variables_of_the_wrong_type_name_the_variable_and_fix(plan_one: Plan, var: str, value: object,
                                                                    words: str) -> None:
    f = finding(plan_one(**CPU, **{var: value}), "input")
    assert words in f.message and f.fix is not None
    assert ("whole GiB" if var == "vllm_cpu_kvcache_space" else "one per instance") in f.fix


def test_cpu_variables_on_a_gpu_build_warn(plan_one: Plan) -> None:
    f = finding(plan_one(**A10, gpu_count=1, vllm_cpu_kvcache_space=1), "cpu-settings-gpu-build")
    assert f.severity is Severity.WARNING and "vLLM 0.34.0 is not a CPU build" in f.message
    assert f.fix is not None and "0.32.0+cpu" in f.fix
    assert "cpu-settings-gpu-build" not in codes(plan_one(**A10, gpu_count=1, vllm_cpu_kvcache_space=1,
                                                           vllm_env={"VLLM_TARGET_DEVICE": "cpu"}))


def test_progress_thresholds_are_inventory_variables_checked_at_plan_time(plan_one: Plan) -> None:
    # The watchdog's thresholds (docs/progress.md) plan like any vllm_* variable: set, they are accepted;
    # out of range, the plan names the variable and its fix instead of failing later in status or watch.
    ok = plan_one(**A10, gpu_count=1, vllm_progress_window=2, vllm_progress_min_tokens=1)
    assert not [f for f in ok.findings if f.code == "input"]
    f = finding(plan_one(**A10, gpu_count=1, vllm_progress_window=0), "input")
    assert "vllm_progress_window" in f.message and f.fix is not None and "vllm_progress_window" in f.fix
