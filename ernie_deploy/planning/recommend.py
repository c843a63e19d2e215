"""The recommended-config table (data/recommendations.yml): defaults, workload profiles, hardware rows. A row
written by `ernie-deploy calibrate` also carries `measured:` (where, when and with which vLLM its settings were
measured, the workload and the numbers: docs/calibrate.md); plan and explain name it as the row's source."""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.errors import ConfigError, DeployError
from ernie_deploy.planning.datafiles import bundled, expect, load_yaml, mapping
from ernie_deploy.planning.hardware import Catalog, GpuType
from ernie_deploy.planning.settings import SETTING_TYPES, check_type


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    max_model_len: int | None
    args: tuple[str, ...]


# The measured row's words that reach plan's output and a unit file's header comment: one line, no shell or
# systemd meaning (a host name, an ISO date, a version).
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@-]*")


@dataclass(frozen=True)
class Measured:
    """Where a row's settings were measured (`ernie-deploy calibrate`): host, date (ISO 8601, UTC), the vLLM
    version that ran, the workload and the numbers as written."""

    host: str
    date: str
    vllm_version: str
    workload: Mapping[str, Any]
    results: Mapping[str, Any]

    def describe(self) -> str:
        return f"measured on {self.host} at {self.date} (vLLM {self.vllm_version})"


@dataclass(frozen=True)
class Row:
    """`name` is what plan and explain show as the row (the source of its settings); a measured row's name says
    where and when it was measured, after the name the file gives it."""

    name: str
    gpu_models: tuple[GpuType, ...]
    gpu_count: int
    use: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    measured: Measured | None = None

    def describe(self) -> str:
        models = " or ".join(g.name for g in self.gpu_models)
        return f"{self.name} ({self.gpu_count} × {models})"


@dataclass(frozen=True)
class Table:
    path: str
    defaults: Mapping[str, Any]
    profiles: Mapping[str, Profile]
    rows: tuple[Row, ...]

    def match(self, gpu: GpuType, count: int) -> Row | None:
        """The first row for this GPU model and count."""
        for row in self.rows:
            if count == row.gpu_count and any(g.name == gpu.name for g in row.gpu_models):
                return row
        return None

    def profile(self, name: str, where: str) -> Profile:
        if name not in self.profiles:
            raise DeployError(f"unknown profile {name!r}", where=where,
                              hint=f"use one of {', '.join(self.profiles)} (defined in {self.path})")
        return self.profiles[name]


def _settings(entry: Mapping[str, Any], where: str, key: str, reserved: set[str]) -> dict[str, Any]:
    out = {}
    for name, value in entry.items():
        if name in reserved:
            continue
        if name not in SETTING_TYPES or SETTING_TYPES[name].secret:
            raise ConfigError(f"{key}.{name}: not a setting a table can set", where=where,
                              hint=f"settings: {', '.join(n for n, t in SETTING_TYPES.items() if not t.secret)}")
        out[name] = check_type(name, value, f"{where}: {key}.{name}")
    return out


def _measured(value: Any, where: str, key: str) -> Measured:
    entry = mapping(value, where, key)
    words = {}
    for name in ("host", "date", "vllm_version"):
        raw = entry.get(name)
        # YAML reads an unquoted 2025-06-01 as a date: the same day.
        text = raw.isoformat() if isinstance(raw, (datetime.date, datetime.datetime)) else raw
        if not isinstance(text, str) or not _WORD.fullmatch(text):
            raise ConfigError(f"{key}.{name}: expected a word of letters, digits and ._:+@-, got {raw!r}",
                              where=where, hint="rerun ernie-deploy calibrate to write the row again")
        words[name] = text
    return Measured(host=words["host"], date=words["date"], vllm_version=words["vllm_version"],
                    workload=mapping(entry.get("workload"), where, f"{key}.workload"),
                    results=mapping(entry.get("results"), where, f"{key}.results"))


def load_table(catalog: Catalog, path: Path | None = None) -> Table:
    path = path or bundled("recommendations.yml")
    where = str(path)
    data = mapping(load_yaml(path), where, "(top level)")
    defaults = _settings(mapping(data.get("defaults"), where, "defaults"), where, "defaults", set())
    profiles = {}
    for name, entry in mapping(data.get("profiles"), where, "profiles").items():
        key = f"profiles.{name}"
        entry = mapping(entry, where, key)
        mml = entry.get("max_model_len")
        profiles[str(name)] = Profile(
            name=str(name),
            description=str(entry.get("description", "")),
            max_model_len=expect(mml, int, where, f"{key}.max_model_len") if mml is not None else None,
            args=tuple(str(a) for a in expect(entry.get("args", []), list, where, f"{key}.args")),
        )
    rows = []
    for i, entry in enumerate(expect(data.get("rows", []), list, where, "rows")):
        key = f"rows[{i}]"
        entry = mapping(entry, where, key)
        models = entry.get("gpu_model")
        names = models if isinstance(models, list) else [models]
        gpus = []
        for gpu_name in names:
            gpu = catalog.lookup(str(gpu_name)) if gpu_name is not None else None
            if gpu is None:
                raise ConfigError(f"{key}.gpu_model: unknown GPU {gpu_name!r}", where=where,
                                  hint=f"use a name from the GPU catalog: {', '.join(catalog.names())}")
            gpus.append(gpu)
        measured = _measured(entry["measured"], where, f"{key}.measured") if "measured" in entry else None
        name = str(entry.get("name", key))
        row = Row(
            name=f"{name}, {measured.describe()}" if measured else name,
            gpu_models=tuple(gpus),
            gpu_count=expect(entry.get("gpu_count"), int, where, f"{key}.gpu_count"),
            use=str(entry.get("use", "")),
            settings=_settings(entry, where, key, {"name", "gpu_model", "gpu_count", "use", "measured"}),
            measured=measured,
        )
        if row.settings.get("profile", "dev") not in profiles and "profile" in row.settings:
            raise ConfigError(f"{key}.profile: unknown profile {row.settings['profile']!r}", where=where)
        rows.append(row)
    return Table(where, defaults, profiles, tuple(rows))
