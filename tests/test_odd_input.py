"""No input ends in a traceback: odd YAML values through `inventory`, `plan` and `render` give an answer or a
clear error (exit 0, 1 or 5), never an unexpected exception."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ernie_deploy.cli.main import main

NAMES = ["gpu_model", "gpu_count", "ansible_host", "ansible_port", "ansible_user", "vllm_port", "vllm_instances",
         "vllm_tensor_parallel_size", "vllm_max_model_len", "vllm_extra_args", "vllm_env", "vllm_model",
         "vllm_served_model_name", "vllm_gpu_memory_utilization", "vllm_profile", "vllm_version", "vllm_host",
         "vllm_stable_seconds", "vllm_keep_releases", "hf_token", "vllm_api_key", "vllm_allow_fallback", "x"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.text(max_size=12), st.dates(dt.date(1970, 1, 1), dt.date(2100, 1, 1)))
keys = st.one_of(st.text(max_size=5), st.integers(-5, 5), st.booleans(), st.none(), st.floats(-2, 2, allow_nan=False))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(keys, inner, max_size=3)), max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(host_vars=st.dictionaries(st.sampled_from(NAMES), values, max_size=4))
def test_odd_values_never_end_in_a_traceback(tmp_path: Path, host_vars: dict[str, object]) -> None:
    inv = tmp_path / "inv.yml"
    base = {"ansible_host": "127.0.0.1", "gpu_model": "NVIDIA A10", "gpu_count": 1}
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"h": {**base, **host_vars}}}}))
    for argv in (["inventory", "--list"], ["inventory", "--host", "h"], ["plan", "--json"],
                 ["render", "-o", str(tmp_path / "out"), "--json"]):
        code = main([argv[0], "-i", str(inv), *argv[1:]])
        assert code in (0, 1, 5), (argv, host_vars, code)
