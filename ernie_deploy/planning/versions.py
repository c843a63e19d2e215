"""vLLM version facts (data/vllm_versions.yml): which architectures and flags a pinned version has."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any

from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.datafiles import bundled, load_yaml, mapping

Version = tuple[int, ...]


class Presence(Enum):
    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


def parse_version(text: str, where: str = "vllm_version") -> Version:
    match = re.fullmatch(r"v?(\d+(?:\.\d+){1,3})(?:[.+-].*)?", str(text).strip())
    if not match:
        raise ConfigError(f"not a vLLM version: {text!r}", where=where, hint="use a release number like 0.11.0")
    return tuple(int(part) for part in match.group(1).split("."))


@dataclass(frozen=True)
class Observed:
    """When something was seen in vLLM releases."""

    since: Version
    absent_until: Version | None
    last_seen: Version | None
    absent_from: Version | None
    note: str

    def presence(self, version: Version) -> Presence:
        if self.absent_until is not None and version <= self.absent_until:
            return Presence.ABSENT
        if self.absent_from is not None and version >= self.absent_from:
            return Presence.ABSENT
        if version >= self.since and (self.last_seen is None or version <= self.last_seen):
            return Presence.PRESENT
        return Presence.UNKNOWN


@dataclass(frozen=True)
class VersionFacts:
    default: str
    architectures: dict[str, Observed]
    flags: dict[str, Observed]


def _observed(entry: Any, where: str, key: str) -> Observed:
    entry = mapping(entry, where, key)

    def v(name: str) -> Version | None:
        return parse_version(entry[name], f"{where}: {key}.{name}") if entry.get(name) else None

    since = v("since")
    if since is None:
        raise ConfigError(f"{key}.since is required", where=where)
    return Observed(since, v("absent_until"), v("last_seen"), v("absent_from"),
                    str(entry.get("note") or entry.get("fix") or ""))


@cache
def version_facts() -> VersionFacts:
    path = bundled("vllm_versions.yml")
    where = str(path)
    data = mapping(load_yaml(path), where, "(top level)")
    return VersionFacts(
        default=str(data["default"]),
        architectures={k: _observed(e, where, f"architectures.{k}")
                       for k, e in mapping(data.get("architectures"), where, "architectures").items()},
        flags={k: _observed(e, where, f"flags.{k}") for k, e in mapping(data.get("flags"), where, "flags").items()},
    )
