"""The settings a plan is made of, where each value came from, and the secret type.

Every setting can come from the table's defaults, a workload profile, a hardware row, or an inventory
variable named `vllm_<setting>`; `explain` shows which.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ernie_deploy.checks.progress import VARIABLES as PROGRESS_VARIABLES
from ernie_deploy.checks.progress import thresholds_of
from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.coerce import coerce
from ernie_deploy.inventory.resolve import is_template


class Secret:
    """A value that must never be printed: shows as [REDACTED] in repr, str, JSON and diffs."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "[REDACTED]"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting may take: from `low` (excluded when `low_open`) to `high`, and the fix."""

    low: float
    high: float = math.inf
    low_open: bool = False
    fix: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return math.isfinite(value) and above and value <= self.high

    def describe(self) -> str:
        low = f"above {self.low:g}" if self.low_open else f"at least {self.low:g}"
        return low if math.isinf(self.high) else f"{low} and at most {self.high:g}"


@dataclass(frozen=True)
class SettingType:
    kind: type | tuple[type, ...]
    secret: bool = False
    item: type | None = None  # element type of lists, value type of dicts
    hint: str | None = None  # the fix for a value of the wrong type, where the type alone does not say it
    bounds: Bounds | None = None  # numeric settings: the range `plan` accepts


# The last TCP port; instance k listens on vllm_port + k (planning/plan.py checks the last one too).
MAX_PORT = 65535


# The type of each setting; inventory variables are `vllm_` + name (secrets: see SECRET_VARS).
SETTING_TYPES: dict[str, SettingType] = {
    "profile": SettingType(str),
    "max_model_len": SettingType(int, bounds=Bounds(1, fix="to the context length in tokens, e.g. 4096, "
                                                               "or remove it to use the model's own")),
    "tensor_parallel_size": SettingType(int, bounds=Bounds(1, fix="to the GPUs per instance, e.g. 1")),
    "pipeline_parallel_size": SettingType(int, bounds=Bounds(1, fix="to 1 (one pipeline stage) or more")),
    # vLLM takes this fraction of each GPU's memory: 0 leaves no room for weights, above 1 is more than exists.
    "gpu_memory_utilization": SettingType((int, float), bounds=Bounds(0, 1, low_open=True,
                                                                      fix="to a fraction, e.g. 0.9")),
    "instances": SettingType(int, bounds=Bounds(1, fix="to 1 or more")),
    "share_gpus": SettingType(bool),
    "port": SettingType(int, bounds=Bounds(1, MAX_PORT, fix="to a free TCP port, e.g. 8000")),
    "host": SettingType(str),
    "model": SettingType(str),
    "model_config": SettingType(str),
    "served_model_name": SettingType(str),
    "served_model_name_suffix": SettingType(bool),
    "bin": SettingType(str),
    "version": SettingType(str),
    "extra_args": SettingType(list, item=str),
    "user": SettingType(str),
    "env": SettingType(dict, item=str),
    "drain_timeout": SettingType(int, bounds=Bounds(0, fix="to the seconds vLLM may drain, e.g. 30")),
    "startup_budget": SettingType((int, float), bounds=Bounds(0, low_open=True,
                                                              fix="to the seconds a start may take, e.g. 600")),
    "keep_releases": SettingType(int, bounds=Bounds(1, fix="to 1 or more, e.g. 5")),
    "stable_seconds": SettingType((int, float), bounds=Bounds(0, fix="to 0 or more seconds, e.g. 10")),
    # Read by the rollout (orchestration/rollout.py: one value for all hosts in scope), not by the plan.
    "serial": SettingType((int, str), hint="a host count, a percentage (30%), a list (1,2,50%) or all"),
    "allow_fallback": SettingType(bool),
    "api_key": SettingType(str, secret=True),
    # Provisioning (docs/provisioning.md): where vLLM and the model come from.
    "pip_index_url": SettingType(str, secret=True),  # may carry index credentials
    "pip_find_links": SettingType(str),
    "install_os_packages": SettingType(bool),
    "model_source": SettingType(str),
    # vLLM's CPU backend (docs/variables.md#vllms-cpu-backend), rendered as VLLM_CPU_KVCACHE_SPACE and
    # VLLM_CPU_OMP_THREADS_BIND. vLLM reads the first with int() (0.32.0 vllm/envs.py:887,
    # vllm/platforms/cpu.py:326), so a fraction of a GiB would stop it at start-up.
    "cpu_kvcache_space": SettingType(int, hint="give whole GiB per worker rank, e.g. 1: vLLM reads "
                                               "VLLM_CPU_KVCACHE_SPACE as an integer"),
    "cpu_omp_threads_bind": SettingType((str, list), item=str,
                                        hint="give one string for every instance (auto, nobind or CPU lists "
                                             "like 0-3|4-7), or a list of such strings, one per instance"),
    # The HAProxy weight of each of the host's instances on the fleet's balancers (planning/balancer.py); unset,
    # an instance weighs its GPUs (TP × PP). HAProxy takes 1..256 (configuration.txt 5.2, "weight").
    "balancer_weight": SettingType(int, bounds=Bounds(1, 256, fix="to the instance's relative capacity, 1 to 256")),
}
# Variables of a balancer host (group vllm_balancers, planning/balancer.py), read there and not by a vLLM host's
# plan: set in group_vars/all they reach every host, where they mean nothing and are no typo.
BALANCER_TYPES: dict[str, SettingType] = {
    "balancer_port": SettingType(int, bounds=Bounds(1, MAX_PORT, fix="to a free TCP port, e.g. 8080")),
    "balancer_bind": SettingType(str, hint="give an IP address, e.g. 0.0.0.0 (every IPv4 address) or ::"),
    "balancer_admin_socket": SettingType(str, hint="give an absolute path, e.g. /run/haproxy/admin.sock"),
    "balancer_config": SettingType(str, hint="give an absolute path, e.g. /etc/haproxy/haproxy.cfg"),
    # Below 0.1 s the checks (a completion each) would load the instances more than they tell.
    "balancer_check_interval": SettingType((int, float), bounds=Bounds(0.1, 3600, fix="to seconds, e.g. 2")),
    "balancer_template": SettingType(str, hint="give the path of a Jinja2 file on this machine"),
}
# `ernie-deploy bench`'s workload and SLOs (planning/bench.py, docs/bench.md): on a vLLM host or its groups, shown
# by `explain`; they change nothing a unit runs. Lengths are tokens, latencies milliseconds (vllm bench serve's
# unit), throughputs per second.
BENCH_TYPES: dict[str, SettingType] = {
    "bench_input_len": SettingType(int, bounds=Bounds(1, fix="to the prompt length in tokens, e.g. 128")),
    "bench_output_len": SettingType(int, bounds=Bounds(1, fix="to the tokens each request generates, e.g. 128")),
    "bench_num_prompts": SettingType(int, bounds=Bounds(1, 100000, fix="to the requests one bench sends, e.g. 50")),
    "bench_request_rate": SettingType((int, float), bounds=Bounds(0, low_open=True,
                                                                  fix="to requests per second, e.g. 4, or remove "
                                                                      "it to send them all at once")),
    "bench_max_concurrency": SettingType(int, bounds=Bounds(1, fix="to the requests in flight at most, e.g. 8")),
    "bench_timeout": SettingType((int, float), bounds=Bounds(0, 86400, low_open=True,
                                                             fix="to the seconds one bench may run, e.g. 300")),
    "bench_seed": SettingType(int, bounds=Bounds(0, 2**32 - 1, fix="to a whole number, e.g. 0")),
    "slo_ttft_p99_ms": SettingType((int, float), bounds=Bounds(0, low_open=True,
                                                               fix="to milliseconds, e.g. 3500")),
    "slo_tpot_p99_ms": SettingType((int, float), bounds=Bounds(0, low_open=True, fix="to milliseconds, e.g. 100")),
    "slo_itl_p99_ms": SettingType((int, float), bounds=Bounds(0, low_open=True, fix="to milliseconds, e.g. 200")),
    "slo_min_output_throughput": SettingType((int, float), bounds=Bounds(0, low_open=True,
                                                                         fix="to output tokens per second, e.g. 100")),
    "slo_min_goodput": SettingType((int, float), bounds=Bounds(0, low_open=True,
                                                               fix="to requests per second, e.g. 1")),
}
# Secrets whose inventory name does not follow the vllm_ prefix.
SECRET_VARS = {"hf_token": "hf_token"}
# Every inventory variable that holds a secret: the vllm_* settings marked secret, and hf_token.
SECRET_INVENTORY_VARS = frozenset({f"vllm_{n}" for types in (SETTING_TYPES, BALANCER_TYPES, BENCH_TYPES)
                                   for n, t in types.items() if t.secret} | set(SECRET_VARS))
# Each secret may instead name a file on the controller that holds it (vllm_api_key_file, hf_token_file): the
# value then lives in no inventory at all (inventory/resolve.py reads it where it is used).
SECRET_FILE_VARS = {f"{var}_file": var for var in sorted(SECRET_INVENTORY_VARS)}


# lookup('env', NAME) of an unset variable is '' in Ansible: an empty secret is that mistake far more often than
# a wish (an empty vllm_api_key would serve with no key at all).
EMPTY_SECRET_HINT = "give the secret a value: is the environment variable or file it is looked up from set?"


def redacted_secrets(host_vars: Mapping[str, Any]) -> dict[str, Any]:
    """Raw inventory variables for display: a secret's plain value becomes [REDACTED]; a value that reveals
    nothing by itself (vault ciphertext, a template such as a lookup) is kept."""
    return {k: "[REDACTED]" if k in SECRET_INVENTORY_VARS and isinstance(v, str) and not is_template(v) else v
            for k, v in host_vars.items()}
DEFAULTS: dict[str, Any] = {
    "pipeline_parallel_size": 1,
    "instances": 1,
    "share_gpus": False,
    "model": "/models/ERNIE-4.5-0.3B-PT",
    "extra_args": [],
    "user": "vllm",
    "env": {},
    "drain_timeout": 30,
    # Seconds a (re)started instance may take to become ready: real loads (weights, torch.compile, CUDA
    # graphs) take minutes; the lab's simulator takes seconds.
    "startup_budget": 600,
    # Releases kept on each host for rollback (docs/releases.md).
    "keep_releases": 5,
    # Seconds a (re)started instance must stay healthy before it counts as ready, and how long a running
    # instance must have stayed up since systemd last restarted it to count as serving (not crash-looping).
    "stable_seconds": 10,
    "allow_fallback": False,
}


VENV_ROOT = "/opt/vllm"


def venv_dir(version: str) -> str:
    """The venv provisioning installs vLLM `version` into."""
    return f"{VENV_ROOT}/{version}"


def venv_bin(version: str) -> str:
    """vllm_bin's default: the console script of the per-version venv."""
    return f"{venv_dir(version)}/bin/vllm"


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str
    where: str = ""  # an inventory variable's file (or -e), when the inventory was read with origins


def check_type(name: str, value: Any, where: str, types: Mapping[str, SettingType] = SETTING_TYPES) -> Any:
    """Validate one setting value (of `types`); returns it (secrets wrapped) or raises naming the variable."""
    spec = types[name]
    kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
    value = coerce(value, kinds)
    bad = (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds)
    if not bad and spec.item is not None:
        items = value.values() if isinstance(value, dict) else value
        bad = any(isinstance(v, bool) or not isinstance(v, spec.item) for v in items)
        bad = bad or (isinstance(value, dict) and any(not isinstance(k, str) for k in value))
    if bad:
        wanted = " or ".join(k.__name__ for k in kinds)
        if spec.item is not None:
            wanted += f" of {spec.item.__name__}"
        shown = "[REDACTED]" if spec.secret else repr(value)
        raise InventoryError(f"vllm_{name} must be {wanted}, got {type(value).__name__} {shown}", where=where,
                             hint=spec.hint)
    if spec.secret and isinstance(value, str) and not value.strip():
        raise InventoryError(f"vllm_{name} is empty", where=where, hint=EMPTY_SECRET_HINT)
    if spec.bounds is not None and not spec.bounds.holds(value):
        raise InventoryError(f"vllm_{name} must be {spec.bounds.describe()}, got {value!r}", where=where,
                             hint=f"set vllm_{name} {spec.bounds.fix}")
    return Secret(value) if spec.secret else value


class InputErrors(InventoryError):
    """Every problem found in one host's variables, so one run names them all."""

    def __init__(self, problems: Sequence[InventoryError], where: str) -> None:
        self.problems = tuple(problems)
        lines = "".join(f"\n  - {p.message}" + (f" (fix: {p.hint})" if p.hint else "") for p in self.problems)
        super().__init__(f"{len(self.problems)} problems in its variables:{lines}", where=where,
                         hint="fix each of them, then run again")


def raise_all(problems: Sequence[InventoryError], where: str) -> None:
    """Raise the one problem as it is, several as one InputErrors; nothing when there are none."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise InputErrors(problems, where)


# Variables every plan needs, read without the vllm_ prefix: when one is not set, a near miss is its typo.
REQUIRED_VARS = ("gpu_model", "gpu_count")


def inventory_settings(host_vars: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The vllm_* settings a host's variables set, validated. Raises every problem at once: unknown vllm_*
    names and near misses of gpu_model and gpu_count, each with the closest known name, and
    values of the wrong type or out of range."""
    found: dict[str, Any] = {}
    problems: list[InventoryError] = []
    known = [f"vllm_{n}" for n in (*SETTING_TYPES, *BALANCER_TYPES, *BENCH_TYPES)] + list(PROGRESS_VARIABLES)
    # Keys first, each value only where it is checked: reading a value may decrypt or render it (inventory/
    # resolve.py), and a variable ernie-deploy does not read (a vaulted become password) must not need that.
    for var in host_vars:
        if var in PROGRESS_VARIABLES:
            continue  # checked together below: the watchdog's thresholds (checks/progress.py)
        if not var.startswith("vllm_"):
            close = difflib.get_close_matches(var, [v for v in REQUIRED_VARS if v not in host_vars], n=1, cutoff=0.8)
            if close:
                problems.append(InventoryError(f"unknown variable {var}", where=where,
                                               hint=f"did you mean {close[0]}?"))
            continue
        name = var.removeprefix("vllm_")
        if name in BALANCER_TYPES:
            continue
        if name in BENCH_TYPES:
            try:
                found[name] = check_type(name, host_vars[var], where, BENCH_TYPES)
            except InventoryError as exc:
                problems.append(exc)
            continue
        if name not in SETTING_TYPES:
            close = difflib.get_close_matches(var, known, n=1)
            problems.append(InventoryError(f"unknown variable {var}", where=where,
                                           hint=f"did you mean {close[0]}?" if close else "see docs/variables.md"))
            continue
        try:
            found[name] = check_type(name, host_vars[var], where)
        except InventoryError as exc:
            problems.append(exc)
    try:
        thresholds_of(where, host_vars)
    except InventoryError as exc:
        problems.append(exc)
    raise_all(problems, where)
    return found


def host_secrets(host_vars: Mapping[str, Any], where: str) -> dict[str, Secret]:
    """Secrets for the env file, keyed by the environment variable vLLM reads."""
    secrets: dict[str, Secret] = {}
    token = host_vars.get("hf_token")
    if token is not None:
        if not isinstance(token, str):
            raise InventoryError("hf_token must be a string", where=where)
        if not token.strip():
            raise InventoryError("hf_token is empty", where=where, hint=EMPTY_SECRET_HINT)
        secrets["HF_TOKEN"] = Secret(token)
    return secrets
