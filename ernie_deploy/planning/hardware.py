"""The GPU catalog (data/gpus.yml), keyed by the exact names nvidia-smi prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.datafiles import bundled, expect, load_yaml, mapping

MIB = 2**20


@dataclass(frozen=True)
class GpuType:
    name: str
    aliases: tuple[str, ...]
    memory_mib: int
    nvlink: bool
    compute_capability: str

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


@dataclass(frozen=True)
class Catalog:
    gpus: tuple[GpuType, ...]

    def lookup(self, name: str) -> GpuType | None:
        """Find a GPU by its nvidia-smi name or an alias, ignoring case."""
        wanted = name.strip().casefold()
        for gpu in self.gpus:
            if wanted == gpu.name.casefold() or wanted in (a.casefold() for a in gpu.aliases):
                return gpu
        return None

    def names(self) -> list[str]:
        return [gpu.name for gpu in self.gpus]


def load_catalog(path: Path | None = None) -> Catalog:
    path = path or bundled("gpus.yml")
    where = str(path)
    data = mapping(load_yaml(path), where, "(top level)")
    entries = mapping(data.get("gpus"), where, "gpus")
    gpus = []
    for name, entry in entries.items():
        key = f"gpus.{name}"
        entry = mapping(entry, where, key)
        gpus.append(GpuType(
            name=str(name),
            aliases=tuple(str(a) for a in expect(entry.get("aliases", []), list, where, f"{key}.aliases")),
            memory_mib=expect(entry.get("memory_mib"), int, where, f"{key}.memory_mib"),
            nvlink=expect(entry.get("nvlink", False), bool, where, f"{key}.nvlink"),
            compute_capability=str(entry.get("compute_capability", "")),
        ))
    if not gpus:
        raise ConfigError("the GPU catalog is empty", where=where)
    return Catalog(tuple(gpus))
