"""The group and host tree of a YAML inventory, built the way ansible-core's `yaml` inventory plugin does.

Where Ansible only warns about a malformed inventory (an unknown key, a group that is not a mapping)
we raise InventoryError instead: a deploy tool must not silently skip hosts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.patterns import expand_host_key
from ernie_deploy.inventory.yamlfile import Marked, plain, type_name

_SECTIONS = ("vars", "children", "hosts")
BUILTIN_GROUPS = ("all", "ungrouped")


@dataclass
class Group:
    name: str
    vars: dict[str, Any] = field(default_factory=dict)
    priority: int = 1
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)  # variable → file:line of its last definition


class GroupBuilder:
    """Builds groups and hosts from the YAML document the way ansible-core's yaml plugin does."""

    def __init__(self, shown: str) -> None:
        self.shown = shown
        self.groups: dict[str, Group] = {name: Group(name) for name in BUILTIN_GROUPS}
        self.host_vars: dict[str, dict[str, Any]] = {}  # inventory-file host vars, in creation order
        # host → its direct groups (an ordered set): membership tests stay O(1) on 100k-host inventories.
        self.host_groups: dict[str, dict[str, None]] = {}
        self.host_files: dict[str, str] = {}  # host → the file that last gave it variables
        self.add_child("all", "ungrouped", where=shown)

    @staticmethod
    def line(mapping: Any, key: Any) -> int:
        key_lines: Mapping[Any, int] = getattr(mapping, "key_lines", {})
        own_line: int = getattr(mapping, "line", 1)
        return key_lines.get(key, own_line)

    def where(self, mapping: Any, key: Any, path: str) -> str:
        return f"{self.shown}:{self.line(mapping, key)}: {path}"

    def parse_document(self, data: Any, file: str | None = None) -> None:
        """Add one inventory document (`file` names it in messages; one builder reads every source)."""
        if file is not None:
            self.shown = file
        if not data:
            return  # an empty file is an empty inventory
        if not isinstance(data, dict):
            raise InventoryError(f"a YAML inventory must be a mapping of groups, got {type_name(data)}",
                                 where=f"{self.shown}:1", hint="start the file with `all:`")
        if "plugin" in data:
            raise InventoryError("this is an inventory plugin configuration, not a YAML inventory",
                                 where=self.where(data, "plugin", "plugin"),
                                 hint="use a static YAML inventory (all: / children: / hosts:)")
        for name, body in data.items():
            self.parse_group(name, body, data, str(name))

    def parse_group(self, name: Any, body: Any, parent: Any, path: str) -> str:
        where = self.where(parent, name, path)
        if not isinstance(name, str) or not name:
            raise InventoryError(f"group name must be a non-empty string, got {name!r}", where=where,
                                 hint="quote the group name")
        if body is not None and not isinstance(body, dict):
            raise InventoryError(f"group '{name}' must be a mapping (hosts/vars/children), got "
                                 f"{type_name(body)}", where=where,
                                 hint="write `hosts:`, `vars:` or `children:` under the group name")
        self.groups.setdefault(name, Group(name))
        for key, value in (body or {}).items():
            self._parse_section(name, key, value, body, f"{path}.{key}")
        return name

    def _parse_section(self, group: str, key: Any, value: Any, body: Any, path: str) -> None:
        where = self.where(body, key, path)
        if key not in _SECTIONS:
            raise InventoryError(f"unexpected key '{key}' in group '{group}'; only \"vars\", \"children\" "
                                 "and \"hosts\" are valid", where=where,
                                 hint="move it under `vars:` or fix the spelling (ansible-core skips it)")
        if value is None:
            return
        if key != "vars" and isinstance(value, str):
            value = Marked({value: None})  # Ansible accepts `hosts: web1` as a one-item mapping
            value.line, value.key_lines = self.line(body, key), {}
        if not isinstance(value, dict):
            raise InventoryError(f"'{key}' of group '{group}' must be a mapping, got {type_name(value)}",
                                 where=where, hint=f"write `{key}:` entries as `name:` lines, not a list")
        if key == "vars":
            for var, val in value.items():
                self.set_group_var(group, self._var_name(var, value, path), val, self.where(value, var, path))
        elif key == "children":
            for child, child_body in value.items():
                child = self.parse_group(child, child_body, value, f"{path}.{child}")
                self.add_child(group, child, where=self.where(value, child, f"{path}.{child}"))
        else:
            for pattern, host_body in value.items():
                self._parse_host(group, pattern, host_body, value, f"{path}.{pattern}")

    def _parse_host(self, group: str, pattern: Any, body: Any, hosts: Any, path: str) -> None:
        where = self.where(hosts, pattern, path)
        if not isinstance(pattern, str) or not pattern:
            raise InventoryError(f"host name must be a string, got {pattern!r}", where=where,
                                 hint="enclose numeric host names in quotes")
        if body is not None and not isinstance(body, dict):
            raise InventoryError(f"host '{pattern}' must map to its variables or be empty, got "
                                 f"{type_name(body)}", where=where,
                                 hint="write `name:` alone, or `name:` with `var: value` lines under it")
        try:
            names, port = expand_host_key(pattern)
        except ValueError as exc:
            raise InventoryError(f"bad host range in '{pattern}': {exc}", where=where,
                                 hint="write ranges as [01:04], [a:c] or [1:10:2]") from None
        for name in names:
            if name not in self.host_vars:
                # `host:PORT` sets ansible_port only where the host is first defined, as in Ansible.
                self.host_vars[name] = {"ansible_port": port} if port else {}
            if group not in self.host_groups.setdefault(name, {}):
                self.host_groups[name][group] = None
                self.groups[group].hosts.append(name)
            for var, val in (body or {}).items():
                self.host_vars[name][self._var_name(var, body, path)] = plain(val)
            if body:
                self.host_files[name] = self.shown

    def _var_name(self, var: Any, mapping: Any, path: str) -> str:
        if not isinstance(var, str) or not var:
            raise InventoryError(f"variable name must be a string, got {var!r}",
                                 where=self.where(mapping, var, path), hint="quote the variable name")
        return var

    def set_group_var(self, group: str, var: str, value: Any, where: str) -> None:
        if var != "ansible_group_priority":
            self.groups[group].vars[var] = plain(value)
            self.groups[group].origins[var] = f"{where.rsplit(': ', 1)[0]}, group {group}"
            return
        # Ansible stores the priority on the group, not as a variable; None is ignored like it does.
        try:
            self.groups[group].priority = int(value)
        except TypeError:
            pass
        except ValueError:
            raise InventoryError(f"ansible_group_priority must be an integer, got {value!r}", where=where,
                                 hint="set ansible_group_priority to a whole number such as 10") from None

    def ancestors(self, group: str) -> set[str]:
        found: set[str] = set()
        todo = list(self.groups[group].parents)
        while todo:
            name = todo.pop()
            if name not in found:
                found.add(name)
                todo.extend(self.groups[name].parents)
        return found

    def add_child(self, parent: str, child: str, where: str) -> None:
        if parent == child or child in self.ancestors(parent):
            raise InventoryError(f"adding group '{child}' as a child of '{parent}' creates a loop",
                                 where=where, hint="a group cannot contain one of its own ancestors")
        if child not in self.groups[parent].children:
            self.groups[parent].children.append(child)
        if parent not in self.groups[child].parents:
            self.groups[child].parents.append(parent)

    def reconcile(self) -> None:
        """Ansible's reconcile_inventory: parentless groups join `all`; group-less hosts join `ungrouped`."""
        for group in list(self.groups.values()):
            if group.name != "all" and not group.parents:
                self.add_child("all", group.name, where=self.shown)
        ungrouped = self.groups["ungrouped"].hosts
        for host in self.host_vars:
            member_of = self.member_of(host)
            if "ungrouped" in member_of:
                if member_of - set(BUILTIN_GROUPS) and "ungrouped" in self.host_groups[host]:
                    ungrouped.remove(host)
                    del self.host_groups[host]["ungrouped"]
            elif member_of <= {"all"}:
                ungrouped.append(host)
                self.host_groups.setdefault(host, {})["ungrouped"] = None

    def member_of(self, host: str) -> set[str]:
        direct = set(self.host_groups.get(host, ()))
        return direct.union(*(self.ancestors(g) for g in direct))
