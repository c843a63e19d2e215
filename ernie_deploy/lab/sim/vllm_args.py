"""`vllm serve` argument parsing for the simulated vLLM, one flag set per version profile.

Flags are declared in vLLM's order (positional model_tag, then frontend, then engine args) so the
`non-default args: {…}` dict prints its keys in the same order vLLM does.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .vllm_flags import FLAGS_032, Flag
from .vllm_versions import Profile

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's parser for --max-model-len: `1k` = 1000, `1K` = 1024, plain ints as is."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) * _BINARY[suffix]
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. "
                f"Did you mean to use {number}{suffix.lower()} instead?"
            ) from err
    return int(value)


def max_model_len_auto(value: str) -> int:
    """0.34 also accepts -1 / `auto` (fit the length to the KV cache)."""
    return -1 if value.strip().lower() == "auto" else human_readable_int(value)


# 0.32's top-level `vllm` parser reports an unknown serve flag (captured start-unknown-flag.log).
TOP_USAGE_032 = (
    "usage: vllm [-h] [-v]\n"
    "            {chat,complete,serve,launch,bench,collect-env,download-kernels,preload,run-batch,snapshot}\n"
    "            ...\n"
)
# Types of the flags the simulator reads; every other flag keeps its text.
_TYPES: dict[str, Callable[[str], Any]] = {
    "port": int, "seed": int, "max_logprobs": int, "pipeline_parallel_size": int, "tensor_parallel_size": int,
    "data_parallel_size": int, "block_size": int, "gpu_memory_utilization": float, "max_num_batched_tokens": int,
    "max_num_seqs": int, "shutdown_timeout": int, "max_model_len": max_model_len_auto,
}


# Flags whose presence depends on the version: a profile adds them itself, or not (vllm_versions.yml's flags).
_VERSIONED = {"--shutdown-timeout", "--swap-space", "--disable-log-requests"}


def _add_flag(p: argparse.ArgumentParser, flag: Flag) -> None:
    """One real flag as vLLM 0.32 declares it (vllm_flags.py), typed where the simulator reads it."""
    default = list(flag.default) if isinstance(flag.default, tuple) else flag.default
    kw: dict[str, Any] = {"dest": flag.dest, "default": default}
    if flag.kind == "flag":
        kw["action"] = "store_true"
    elif flag.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    elif flag.kind == "append":
        kw["action"] = "append"
    else:
        kw["type"] = _TYPES.get(flag.dest, str)
        if flag.kind != "value":
            kw["nargs"] = flag.kind
        if flag.choices:
            kw["choices"] = flag.choices
    if flag.options:
        p.add_argument(*flag.options, **kw)
    else:
        kw.pop("dest")
        p.add_argument(flag.dest, **kw)


def _all_flags_parser() -> argparse.ArgumentParser:
    """Every real flag of the version (vllm_flags.py), the ones the simulator reads typed."""
    p = argparse.ArgumentParser(prog="vllm serve", usage="vllm serve [model_tag] [options]")
    for flag in FLAGS_032:
        _add_flag(p, flag)
    return p


def _add_other_real_flags(p: argparse.ArgumentParser) -> None:
    """The real flags a profile's own parser does not declare, so a flag `plan` passes through vllm_extra_args
    (`--chat-template`, …) starts the simulated server as it starts the real one; the profile's own
    declarations and its version-dependent flags stay as they are. 0.32's flag set stands in for every
    version: the simulator only reads the flags the profile declares."""
    taken = set(p._option_string_actions)  # argparse's own index of option strings (stable since 3.2)
    for flag in FLAGS_032:
        forms = {*flag.options, *(f"--no-{o[2:]}" for o in flag.options if flag.kind == "bool")}
        if flag.options and not forms & (taken | _VERSIONED):
            _add_flag(p, flag)


def build_parser(profile: Profile) -> argparse.ArgumentParser:
    if profile.all_flags:
        return _all_flags_parser()
    p = argparse.ArgumentParser(prog="vllm serve", usage="vllm serve [model_tag] [options]")
    p.add_argument("model_tag", nargs="?", default=None)
    # Frontend (entrypoints/openai/cli_args.py).
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    if profile.api_key_list:
        p.add_argument("--api-key", nargs="+", default=None)
    else:
        p.add_argument("--api-key", default=None)
    if profile.has_shutdown_timeout:
        p.add_argument("--shutdown-timeout", type=int, default=None)
    # Engine args (engine/arg_utils.py).
    p.add_argument("--model", default=None)
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--seed", type=int, default=None)
    length_type = max_model_len_auto if profile.max_len_auto else (
        human_readable_int if profile.human_readable_ints else int)
    p.add_argument("--max-model-len", type=length_type, default=None)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--generation-config", default="auto")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--served-model-name", nargs="+", default=None)
    # LoadConfig, after ModelConfig; `dummy` (random weights) and the other formats are not checked here.
    p.add_argument("--load-format", default="auto")
    p.add_argument("--distributed-executor-backend", default=None, choices=["ray", "mp", "uni", "external_launcher"])
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--disable-custom-all-reduce", action="store_true")
    p.add_argument("--block-size", type=int, default=None, choices=[1, 8, 16, 32, 64, 128])
    p.add_argument("--gpu-memory-utilization", type=float, default=None if profile.max_len_auto else
                   profile.gpu_util_default)
    if profile.has_swap_space:
        p.add_argument("--swap-space", type=float, default=4)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--enable-log-requests", action="store_true")
    if profile.disable_log_requests is not None:
        p.add_argument("--disable-log-requests", action="store_true")
    _add_other_real_flags(p)
    return p


def parse_serve_args(argv: list[str], profile: Profile) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse `vllm serve` arguments; unknown flags exit 2 with argparse's own message.

    Returns the namespace and the non-default args dict that vLLM logs.
    """
    parser = build_parser(profile)
    if profile.all_flags:
        args, unknown = parser.parse_known_args(dashes(argv))
        if unknown:
            _top_level_error(f"unrecognized arguments: {' '.join(unknown)}")
    else:
        args = parser.parse_args(argv)
    # The positional model_tag overrides --model (0.11.0 entrypoints/cli/serve.py:46-48); vLLM logs
    # both keys, each in its own place in the dict.
    if args.model_tag is not None:
        args.model = args.model_tag
    # argparse has no public accessor for defaults; the private action list is stable since 3.2.
    defaults = {action.dest: action.default for action in parser._actions}
    non_default = {key: value for key, value in vars(args).items() if value != defaults.get(key)}
    return args, non_default


def dashes(argv: list[str]) -> list[str]:
    """FlexibleArgumentParser takes `--max_model_len` for `--max-model-len` (utils/argparse_utils.py)."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _top_level_error(message: str) -> NoReturn:
    sys.stderr.write(f"{TOP_USAGE_032}vllm: error: {message}\n")
    sys.exit(2)
