"""Inventory values as Ansible would use them: extra variables on top, `!vault` values decrypted, `{{ }}` rendered.

As in Ansible, this happens where a value is used, not when the inventory is read: a host's variables are a
mapping that resolves each one on first access, so a host a command does not touch never needs its vault
password or its environment variables. `ansible-inventory` (and `ernie-deploy inventory`) show the raw values.

Templating follows ansible-core 2.19: a value made of one `{{ expression }}` keeps the expression's type (a
list stays a list, a string that looks like a number stays a string); anything else renders to a string;
`!unsafe` values and decrypted vault values are never templated. Only the lookups and filters in
docs/inventory-sources.md are offered (inventory/templating.py); any other is refused by name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.inventory import Host, Inventory
from ernie_deploy.inventory.vault import NO_PASSWORD_HINT
from ernie_deploy.inventory.yamlfile import Decrypt, Unsafe, Vaulted

EXTRA_VARS_ORIGIN = "-e/--extra-vars"
_MARKERS = ("{{", "{%", "{#")


@dataclass(frozen=True)
class Resolution:
    """What resolving needs from outside: the controller's environment (lookup('env')), the directory relative
    `lookup('file')` paths start from, the vault, and the extra variables (-e), which win over everything."""

    environ: Mapping[str, str] = field(default_factory=dict)
    base_dir: Path = Path(".")
    decrypt: Decrypt | None = None
    extra_vars: Mapping[str, Any] = field(default_factory=dict)
    # VAR_file → VAR: a variable given as a file on the controller that holds its value (the secrets').
    file_vars: Mapping[str, str] = field(default_factory=dict)


_UNSET = object()


def is_template(value: object) -> bool:
    """Whether a raw inventory value is a Jinja template Ansible would render (an `!unsafe` string never is):
    the one test resolving, redacting for display and the Ansible export share."""
    return isinstance(value, str) and not isinstance(value, Unsafe) and any(m in value for m in _MARKERS)


class _FromFile:
    """The value of VAR read from the controller file VAR_file names (the path may be a template itself)."""

    __slots__ = ("path",)

    def __init__(self, path: Any) -> None:
        self.path = path


def resolve_inventory(inventory: Inventory, resolution: Resolution) -> Inventory:
    """The inventory with every host's variables resolving on use (see the module's docstring)."""
    groups = inventory.group_members()
    hosts = {name: Host(name, HostVars(host, inventory, resolution, groups), host.groups)
             for name, host in inventory.hosts.items()}
    return inventory.replace_hosts(hosts)


class HostVars(Mapping[str, Any]):
    """One host's variables, each resolved on first access. Safe to share between threads."""

    def __init__(self, host: Host, inventory: Inventory, resolution: Resolution,
                 groups: Mapping[str, list[str]]) -> None:
        self._source = host
        self._host = host.name
        self._inventory = inventory
        self._groups = groups
        self.resolution = resolution
        self.magic = {"inventory_hostname": host.name, "inventory_hostname_short": host.name.split(".")[0],
                      "group_names": list(host.groups), "groups": groups}
        self._done: dict[str, Any] = {}
        self._active: set[str] = set()
        self._lock = threading.RLock()
        self._raw = {**host.vars, **resolution.extra_vars}
        self._renamed: dict[str, str] = {}
        for file_var, var in resolution.file_vars.items():
            if file_var in self._raw:
                self._renamed[var] = file_var
                if var in self._raw:
                    raise self.error(var, f"both {var} and {file_var} are set",
                                     f"keep one: {file_var} names a file holding the value")
                self._raw[var] = _FromFile(self._raw.pop(file_var))

    def overlaid(self, variables: Mapping[str, Any]) -> HostVars:
        """These variables over the inventory's and under the extra variables (a play's `vars`)."""
        host = Host(self._host, {**self._source.vars, **variables}, self._source.groups)
        return HostVars(host, self._inventory, self.resolution, self._groups)

    def __getitem__(self, key: str) -> Any:
        done = self._done.get(key, _UNSET)  # resolved already: no lock (a dict read is atomic)
        if done is not _UNSET:
            return done
        with self._lock:
            if key in self._done:
                return self._done[key]
            if key not in self._raw:
                raise KeyError(key)
            if key in self._active:
                raise self.error(key, f"{key} refers to itself through its template (a recursive loop)",
                                 "break the loop: no variable may depend on its own value")
            self._active.add(key)
            try:
                value = self._resolve(key, self._raw[key])
            finally:
                self._active.discard(key)
            self._done[key] = value
            return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def origin(self, key: str) -> str:
        key = self._renamed.get(key, key)
        if key in self.resolution.extra_vars:
            return EXTRA_VARS_ORIGIN
        return self._inventory.origin(self._host, key) or self._inventory.shown

    def error(self, key: str, message: str, hint: str) -> InventoryError:
        """An error naming the variable and the file it comes from (a plan lists it under the host)."""
        name = self._renamed.get(key, key)
        return InventoryError(f"variable {name} (from {self.origin(key)}): {message}", where=self._host, hint=hint)

    def _resolve(self, key: str, value: Any) -> Any:
        if isinstance(value, Vaulted):
            decrypt = self.resolution.decrypt
            if decrypt is None:
                raise self.error(key, "the value is encrypted with ansible-vault and no vault password was given",
                                 NO_PASSWORD_HINT)
            return decrypt(value.text, f"variable {key}", f"{self._host} ({self.origin(key)})")
        if isinstance(value, Unsafe):
            return str(value)
        if isinstance(value, _FromFile):
            path = self._resolve(key, value.path)
            if not isinstance(path, str) or not path:
                raise self.error(key, f"{self._renamed[key]} must be a file path",
                                 f"set {self._renamed[key]} to the path of a file on the controller")
            return read_controller_file(self, key, path, {})
        if isinstance(value, dict):
            return {k: self._resolve(key, v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._resolve(key, v) for v in value]
        if is_template(value):
            from ernie_deploy.inventory.templating import render  # Jinja only for the inventories that use it
            return render(value, self, key)
        return value


def read_controller_file(host: HostVars, key: str, term: Any, options: Mapping[str, Any]) -> str:
    path = Path(str(term)).expanduser()
    path = path if path.is_absolute() else host.resolution.base_dir / path
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise host.error(key, f"lookup('file') cannot read {path}: {getattr(exc, 'strerror', None) or exc}",
                         "give a readable UTF-8 file on the controller (relative paths start at the first "
                         "inventory source's directory)") from None
    # The file lookup's defaults: rstrip=True, lstrip=False.
    if options.get("rstrip", True):
        text = text.rstrip()
    if options.get("lstrip", False):
        text = text.lstrip()
    return text


def with_vars(variables: Mapping[str, Any], overlay: Mapping[str, Any]) -> Mapping[str, Any]:
    """`overlay` over a host's variables, under its extra variables when it has any (a play's `vars`: Ansible
    ranks them above the inventory and below -e)."""
    if isinstance(variables, HostVars):
        return variables.overlaid(overlay)
    return {**variables, **overlay}
