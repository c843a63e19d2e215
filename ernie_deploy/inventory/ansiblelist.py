"""An inventory from the JSON `ansible-inventory --list` prints: the path for every source the bundled reader does
not read (INI, scripts, inventory plugins). Ansible has layered the variables already; `!vault` values arrive as
{"__ansible_vault": text} and `!unsafe` ones as {"__ansible_unsafe": text}, and are turned back into the bundled
reader's types, so both paths hand the planner the same values.

The hosts' order is the groups' walk, as in Ansible, with one thing the JSON cannot tell: hosts written directly
under `all` (rare outside YAML, which the bundled reader reads) come in `ungrouped`'s order, not first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.groups import BUILTIN_GROUPS, Group
from ernie_deploy.inventory.inventory import Inventory
from ernie_deploy.inventory.yamlfile import Unsafe, Vaulted


class GivenVars:
    """Host variables exactly as ansible-inventory gave them (group variables are already folded in)."""

    def __init__(self, hostvars: Mapping[str, dict[str, Any]], shown: str) -> None:
        self._hostvars = hostvars
        self._shown = shown

    def host_vars(self, host: str, ordered_groups: list[str]) -> dict[str, Any]:
        return dict(self._hostvars.get(host, {}))

    def group_vars(self, group: str) -> dict[str, Any]:
        return {}

    def origin(self, host: str, var: str, ordered_groups: list[str]) -> str:
        return self._shown


def from_ansible_list(data: Any, shown: str) -> Inventory:
    """The inventory of an `ansible-inventory --list` document (`shown` names its sources in messages)."""
    if not isinstance(data, dict):
        raise InventoryError("ansible-inventory printed something other than a JSON object", where=shown,
                             hint="run `ansible-inventory -i SOURCE --list` yourself to see what it prints")
    meta = data.get("_meta") or {}
    raw_hostvars = meta.get("hostvars") or {} if isinstance(meta, dict) else {}
    groups: dict[str, Group] = {name: Group(name) for name in BUILTIN_GROUPS}
    for name, body in data.items():
        if name == "_meta":
            continue
        group = groups.setdefault(name, Group(name))
        if isinstance(body, dict):
            group.hosts = [str(h) for h in body.get("hosts") or []]
            group.children = [str(c) for c in body.get("children") or []]
            group.vars = {str(k): _typed(v) for k, v in (body.get("vars") or {}).items()}
    for group in list(groups.values()):
        for child in group.children:
            groups.setdefault(child, Group(child)).parents.append(group.name)
    direct: dict[str, set[str]] = {}
    for group in groups.values():
        for host in group.hosts:
            direct.setdefault(host, set()).add(group.name)
    memberships = {host: _with_ancestors(found, groups) for host, found in direct.items()}
    hostvars = {str(h): {str(k): _typed(v) for k, v in (vs or {}).items()} for h, vs in raw_hostvars.items()}
    return Inventory(shown, groups, memberships, GivenVars(hostvars, shown))


def _with_ancestors(direct: set[str], groups: Mapping[str, Group]) -> set[str]:
    found = set(direct) | {"all"}
    todo = [p for g in direct for p in groups[g].parents]
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(groups[name].parents)
    return found


def _typed(value: Any) -> Any:
    """ansible-inventory's JSON markers back to the types the bundled reader gives."""
    if isinstance(value, dict):
        if set(value) == {"__ansible_vault"} and isinstance(value["__ansible_vault"], str):
            return Vaulted(value["__ansible_vault"])
        if set(value) == {"__ansible_unsafe"} and isinstance(value["__ansible_unsafe"], str):
            return Unsafe(value["__ansible_unsafe"])
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return value
