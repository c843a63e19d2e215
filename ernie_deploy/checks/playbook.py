"""Playbooks: optional YAML files that add checks to `verify` and `deploy` (see playbooks/verify.yml).

    verify:
      stream: true                       # the smoke completion streams (server-sent events)
      expect: ["Using max model len {max_model_len}"]   # must appear in the start-up log
      forbid: ["Custom allreduce is disabled"]          # must not appear

Patterns are regular expressions; `{name}` placeholders take the instance's planned values
(tensor_parallel_size, max_model_len, served_model_name, port, unit, gpu_memory_utilization).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ernie_deploy.checks.logscan import check_pattern
from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.datafiles import expect, load_yaml, mapping


@dataclass(frozen=True)
class Expectations:
    """Playbook additions: extra log patterns, and whether the smoke completion streams."""

    expect: Sequence[str] = ()
    forbid: Sequence[str] = ()
    stream: bool = False


KEYS = {"verify"}
VERIFY_KEYS = {"stream", "expect", "forbid"}


def load_playbook(path: Path) -> Expectations:
    where = str(path)
    data = mapping(load_yaml(path), where, "(top level)")
    for key in data:
        if key not in KEYS:
            raise ConfigError(f"{key}: unknown key", where=where, hint=f"known keys: {', '.join(sorted(KEYS))}")
    verify = mapping(data.get("verify"), where, "verify")
    for key in verify:
        if key not in VERIFY_KEYS:
            raise ConfigError(f"verify.{key}: unknown key", where=where,
                              hint=f"known keys: {', '.join(sorted(VERIFY_KEYS))}")
    patterns = {}
    for key in ("expect", "forbid"):
        items = expect(verify.get(key, []), list, where, f"verify.{key}")
        for i, item in enumerate(items):
            expect(item, str, where, f"verify.{key}[{i}]")
            # A typo in a pattern must stop the run here, before any host is restarted.
            problem = check_pattern(key, item)
            if problem is not None:
                raise ConfigError(f"verify.{key}[{i}]: {problem.message}", where=where, hint=problem.hint)
        patterns[key] = tuple(items)
    return Expectations(expect=patterns["expect"], forbid=patterns["forbid"],
                        stream=expect(verify.get("stream", False), bool, where, "verify.stream"))
