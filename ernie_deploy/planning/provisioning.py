"""What provisioning wants on a host, from its plan and inventory variables, and the pure decisions: which
model files to send, which venvs to remove. No I/O here (docs/provisioning.md)."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ernie_deploy.errors import DeployError, InventoryError
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.settings import VENV_ROOT, Secret, venv_bin

HUB_PREFIX = "hf://"
_HUB = re.compile(r"hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<rev>[A-Za-z0-9._/-]+))?")


@dataclass(frozen=True)
class LocalSource:
    """A model directory on the controller, copied over SSH."""

    path: Path

    def describe(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face Hub repository at a revision, downloaded on the host."""

    repo: str
    revision: str

    def describe(self) -> str:
        return f"hf://{self.repo}@{self.revision}"


ModelSource = LocalSource | HubSource


def parse_source(text: str, base_dir: Path, where: str) -> ModelSource:
    """`hf://ORG/NAME[@REVISION]` (revision defaults to main) or a controller directory (relative to the
    inventory's directory)."""
    if text.startswith(HUB_PREFIX):
        found = _HUB.fullmatch(text)
        if found is None:
            raise InventoryError(f"vllm_model_source {text!r} is not hf://ORG/NAME or hf://ORG/NAME@REVISION",
                                 where=where, hint="e.g. hf://baidu/ERNIE-4.5-0.3B-PT@main")
        return HubSource(found["repo"], found["rev"] or "main")
    path = Path(text).expanduser()
    path = path if path.is_absolute() else base_dir / path
    return LocalSource(path)


@dataclass(frozen=True)
class ProvisionSpec:
    host: str
    version: str
    bin: str  # the vllm console script; its venv is two levels up
    configured_bin: bool  # vllm_bin set (inventory, table): adopt a venv there, never replace one
    user: str
    index_url: Secret | None
    find_links: Path | None
    install_os_packages: bool
    model_path: str
    source: ModelSource | None
    keep_releases: int
    hf_endpoint: str | None
    has_hf_token: bool

    @property
    def venv(self) -> str:
        return posixpath.dirname(posixpath.dirname(self.bin))


def spec_for(plan: HostPlan, host_vars: Mapping[str, object], base_dir: Path) -> ProvisionSpec:
    def setting(name: str) -> object:
        found = plan.settings.get(name)
        return None if found is None else found.value

    where = plan.name
    bin_path = plan.bin
    configured = "bin" in plan.settings and not plan.settings["bin"].source.startswith("default")
    if configured and not re.fullmatch(r"/[A-Za-z0-9._/+-]+/bin/vllm", bin_path):
        raise InventoryError(f"vllm_bin {bin_path!r} is not VENV/bin/vllm, so provisioning cannot tell its venv",
                             where=where, hint=f"leave vllm_bin unset (vLLM goes to {venv_bin(plan.version)})")
    index = setting("pip_index_url")
    links = setting("pip_find_links")
    source = setting("model_source")
    endpoint = plan.env.get("HF_ENDPOINT")
    return ProvisionSpec(
        host=plan.name, version=plan.version, bin=bin_path, configured_bin=configured, user=plan.user,
        index_url=index if isinstance(index, Secret) else None,
        find_links=(base_dir / Path(str(links)).expanduser()) if links else None,
        install_os_packages=bool(setting("install_os_packages")),
        model_path=plan.model_path.rstrip("/") or "/", keep_releases=int(str(setting("keep_releases") or 5)),
        source=parse_source(str(source), base_dir, where) if source else None,
        hf_endpoint=endpoint, has_hf_token="HF_TOKEN" in plan.secrets,
    )


# ---------------------------------------------------------------------------------------------------------
# Manifests: what a directory holds, by relative path.


@dataclass(frozen=True)
class Entry:
    size: int
    sha256: str


Manifest = dict[str, Entry]


@dataclass(frozen=True)
class HostFile:
    size: int
    mtime: str  # as `find -printf %T@` prints it: compared as text, never parsed


@dataclass(frozen=True)
class Recorded:
    """A manifest entry the host keeps: the content and the stat it had when written."""

    size: int
    sha256: str
    mtime: str


def trusted(recorded: Mapping[str, Recorded], present: Mapping[str, HostFile]) -> Manifest:
    """What the host holds according to its recorded manifest, for files whose size and mtime still match
    (a file edited, truncated or replaced since gets no entry: it is re-sent)."""
    out: Manifest = {}
    for rel, rec in recorded.items():
        seen = present.get(rel)
        if seen is not None and seen.size == rec.size and seen.mtime == rec.mtime:
            out[rel] = Entry(rec.size, rec.sha256)
    return out


def to_send(wanted: Manifest, held: Manifest) -> list[str]:
    """Relative paths whose content on the host differs from (or is missing against) the source."""
    return sorted(rel for rel, e in wanted.items() if held.get(rel) != e)


def unknown_on_host(wanted: Manifest, held: Manifest, present: Mapping[str, HostFile]) -> list[str]:
    """Host files the recorded manifest cannot vouch for but whose size matches the source: hashing them
    on the host (once) can spare sending them."""
    return sorted(rel for rel, e in wanted.items()
                  if rel not in held and rel in present and present[rel].size == e.size)


def extra_on_host(wanted: Manifest, present: Mapping[str, HostFile]) -> list[str]:
    """Files in the model directory the source does not have (left out of the switched-in tree)."""
    return sorted(set(present) - set(wanted))


# ---------------------------------------------------------------------------------------------------------
# Venvs


def removable_venvs(ours: list[str], used: set[str], keep: str) -> list[str]:
    """Venvs provisioning installed (marked) that no installed unit and no kept release runs, except the
    pinned one."""
    return sorted(v for v in ours if v not in used and v != keep and v.startswith(VENV_ROOT + "/"))


def os_packages(os_ids: tuple[str, ...]) -> tuple[str, tuple[str, ...]] | None:
    """(package manager command, packages) that bring python3's venv and ensurepip on this OS family
    (/etc/os-release ID and ID_LIKE), or None when the family is unknown."""
    if {"debian", "ubuntu"} & set(os_ids):
        return "apt-get", ("python3-venv",)
    if {"rhel", "fedora", "centos", "rocky", "almalinux"} & set(os_ids):
        return "dnf", ("python3", "python3-pip")
    return None


_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?(?:/s)?", re.IGNORECASE)


def parse_rate(text: str | None) -> float | None:
    if text is None:
        return None
    found = _RATE.fullmatch(text.strip())
    if found is None or float(found[1]) <= 0:
        raise DeployError(f"--bwlimit {text!r} is not a rate", hint="e.g. 500K, 50M or 1G (bytes per second)")
    return float(found[1]) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[found[2].upper()]
