"""Which NVIDIA driver a vLLM release needs (data/vllm_drivers.yml, sources in docs/drivers.md), and whether a
host's driver is new enough. Pure: the table is read once; the host's driver string comes from its facts.

The CUDA version a host must support is the higher of the one torch's wheel is built with and the one vLLM's
own kernels are built with; the driver must be at least that CUDA toolkit's own driver (below the
minor-version-compatibility floor it cannot run the release at all).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.datafiles import bundled, load_yaml, mapping
from ernie_deploy.planning.versions import Version, parse_version


@dataclass(frozen=True)
class DriverNeed:
    vllm: str  # the release asked about
    row: str  # the table row that answered (the nearest lower one when there is no exact row)
    torch: str
    cuda: str  # the CUDA version the host must support
    minimum: str  # that CUDA toolkit's driver: below it the host fails
    floor: str  # the minor-version-compatibility minimum: below it nothing runs

    @property
    def exact(self) -> bool:
        return parse_version(self.row) == parse_version(self.vllm)


@dataclass(frozen=True)
class DriverVerdict:
    ok: bool | None  # None: the driver string is not a version (judged by nobody)
    summary: str


def driver_version(text: str) -> tuple[int, ...] | None:
    """nvidia-smi's driver_version ("550.127.05") as numbers; None for anything that is not dotted numbers
    (nvidia-smi documents the field as an alphanumeric string). Compared as tuples, never as text:
    "570.124.06" is newer than "570.26"."""
    if not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        return None
    return tuple(int(part) for part in text.strip().split("."))


def _padded(version: tuple[int, ...]) -> tuple[int, ...]:
    return version + (0,) * (4 - len(version))


@dataclass(frozen=True)
class _Row:
    torch: str
    cuda: str


@cache
def _table() -> tuple[dict[Version, tuple[str, _Row]], dict[str, tuple[str, str]]]:
    path = bundled("vllm_drivers.yml")
    where = str(path)
    data = mapping(load_yaml(path), where, "(top level)")
    cuda: dict[str, tuple[str, str]] = {}
    for key, entry in mapping(data.get("cuda"), where, "cuda").items():
        entry = mapping(entry, where, f"cuda.{key}")
        cuda[str(key)] = (_text(entry, "toolkit_driver", where, f"cuda.{key}"),
                          _text(entry, "minor_compat_driver", where, f"cuda.{key}"))
    rows: dict[Version, tuple[str, _Row]] = {}
    for key, entry in mapping(data.get("vllm"), where, "vllm").items():
        entry = mapping(entry, where, f"vllm.{key}")
        needed = max((_text(entry, "cuda", where, f"vllm.{key}"), str(entry.get("vllm_cuda") or "0")),
                     key=lambda c: parse_version(c if "." in c else f"{c}.0"))
        if needed not in cuda:
            raise ConfigError(f"vllm.{key} needs CUDA {needed}, which has no cuda row", where=where)
        rows[parse_version(str(key), f"{where}: vllm.{key}")] = (str(key), _Row(_text(entry, "torch", where,
                                                                                         f"vllm.{key}"), needed))
    return rows, cuda


def _text(entry: Mapping[str, Any], key: str, where: str, path: str) -> str:
    value = entry.get(key)
    if value is None:
        raise ConfigError(f"{path}.{key} is required", where=where)
    return str(value)


def releases() -> list[str]:
    """The vLLM releases the table has a row for, oldest first."""
    rows, _ = _table()
    return [rows[v][0] for v in sorted(rows)]


def need(vllm: str) -> DriverNeed | None:
    """What `vllm` needs, from its row or the nearest lower one (CUDA requirements only rose from row to row, so
    that can understate, never overstate); None below the lowest row."""
    rows, cuda = _table()
    wanted = parse_version(vllm)
    lower = [v for v in rows if v <= wanted]
    if not lower:
        return None
    key, row = rows[max(lower)]
    minimum, floor = cuda[row.cuda]
    return DriverNeed(vllm, key, row.torch, row.cuda, minimum, floor)


def judge(driver: str, wanted: DriverNeed) -> DriverVerdict:
    found = driver_version(driver)
    why = (f"vLLM {wanted.vllm} needs CUDA {wanted.cuda} (torch {wanted.torch}), driver >= {wanted.minimum}"
           + ("" if wanted.exact else f"; no row for {wanted.vllm}, used {wanted.row} (unverified)"))
    if found is None:
        return DriverVerdict(None, f"driver {driver!r} is not a version number; {why}")
    floor = driver_version(wanted.floor)
    if _padded(found) >= _padded(driver_version(wanted.minimum) or (0,)):
        return DriverVerdict(True, f"driver {driver} is new enough: {why}")
    cannot = f"; below {wanted.floor} it cannot run at all" if floor and _padded(found) >= _padded(floor) \
        else " (it is even below the minor-version-compatibility minimum)"
    return DriverVerdict(False, f"driver {driver} is too old: {why}{cannot}")
