"""What each `-i` source is, and whether the bundled reader can read it or ansible-inventory must.

The bundled reader serves YAML inventory files and directories of them; every other kind Ansible accepts (INI
files, executable inventory scripts, inventory plugin configurations, `host1,host2,` lists) is read through
ansible-core's own `ansible-inventory`. A directory is walked the way ansible-core's InventoryManager.parse_source
walks it: sorted names, hidden entries, group_vars/, host_vars/ and the ignored extensions skipped, sub-directories
read in place.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ernie_deploy.inventory.vault import is_vaulted
from ernie_deploy.inventory.yamlfile import Loader

# ansible-core's defaults: IGNORED_ALWAYS in inventory/manager.py, and INVENTORY_IGNORE_EXTS (REJECT_EXTS plus
# .orig, .cfg, .retry) in config/base.yml.
_IGNORED_NAMES = (r"^\.", r"^host_vars$", r"^group_vars$", r"^vars_plugins$")
_IGNORED_EXTS = (".pyc", ".pyo", ".swp", ".bak", "~", ".rpm", ".md", ".txt", ".rst", ".orig", ".cfg", ".retry")
IGNORED = re.compile("|".join((*_IGNORED_NAMES, *(re.escape(e) + "$" for e in _IGNORED_EXTS))))
# The yaml inventory plugin's yaml_extensions; it also takes a file with no extension.
YAML_EXTENSIONS = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class Source:
    """One `-i` argument: as given (for messages), and the YAML files the bundled reader would parse for it, or
    why it cannot (`foreign` names the kind, e.g. "an INI inventory")."""

    given: str
    files: tuple[Path, ...] = ()
    foreign: str = ""
    foreign_path: str = ""

    @property
    def basedir(self) -> Path:
        """Where group_vars/ and host_vars/ are looked up: the directory itself, or the file's directory (as
        ansible-core's get_vars_from_inventory_sources does)."""
        path = Path(self.given)
        return Path(os.path.realpath(path if path.is_dir() else path.absolute().parent))


def classify(given: str) -> Source:
    path = Path(given)
    if not path.exists():
        if "," in given:
            return Source(given, foreign="a host list", foreign_path=given)
        return Source(given, foreign="missing")
    if path.is_dir():
        files: list[Path] = []
        for file in _walk(path):
            kind = _file_kind(file)
            if kind:
                return Source(given, foreign=kind, foreign_path=str(file))
            files.append(file)
        return Source(given, tuple(files))
    kind = _file_kind(path)
    return Source(given, foreign=kind, foreign_path=given) if kind else Source(given, (path,))


def _walk(directory: Path) -> list[Path]:
    found: list[Path] = []
    for name in sorted(os.listdir(directory)):
        if IGNORED.search(name):
            continue
        full = directory / name
        found.extend(_walk(full) if full.is_dir() else [full])
    return found


def _file_kind(path: Path) -> str:
    """"" for a YAML inventory the bundled reader parses, else what the file is (ansible-core tries the script,
    yaml and ini plugins in that order; `auto` takes a YAML file whose top level names a `plugin:`)."""
    if os.access(path, os.X_OK):
        return "an executable inventory script"
    ext = path.suffix
    if ext == ".toml":
        return "a TOML inventory"
    if ext and ext not in YAML_EXTENSIONS:
        return "an INI inventory"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""  # the bundled reader names the file and why it cannot read it
    plugin = _PLUGIN.search(text)
    if plugin:
        return f"an inventory plugin configuration ({plugin.group(1).strip()})"
    if ext or is_vaulted(text):
        return ""
    # No extension: ansible-core reads it as YAML when it is a YAML mapping, else as INI.
    try:
        data = yaml.load(text, Loader=Loader)  # Loader is a SafeLoader subclass
    except yaml.YAMLError:
        return "an INI inventory"
    return "" if data is None or isinstance(data, dict) else "an INI inventory"


# The `auto` plugin's test, without parsing a fleet-sized file twice: a top-level `plugin:` key.
_PLUGIN = re.compile(r"^plugin\s*:(.*)$", re.MULTILINE)
