"""The recommended-config table (data/recommendations.yml): defaults, workload profiles, hardware rows."""

from __future__ import annotations

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


@dataclass(frozen=True)
class Row:
    name: str
    gpu_models: tuple[GpuType, ...]
    gpu_count: int
    use: str
    settings: Mapping[str, Any] = field(default_factory=dict)

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
        row = Row(
            name=str(entry.get("name", key)),
            gpu_models=tuple(gpus),
            gpu_count=expect(entry.get("gpu_count"), int, where, f"{key}.gpu_count"),
            use=str(entry.get("use", "")),
            settings=_settings(entry, where, key, {"name", "gpu_model", "gpu_count", "use"}),
        )
        if row.settings.get("profile", "dev") not in profiles and "profile" in row.settings:
            raise ConfigError(f"{key}.profile: unknown profile {row.settings['profile']!r}", where=where)
        rows.append(row)
    return Table(where, defaults, profiles, tuple(rows))
