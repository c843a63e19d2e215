"""Ansible-compatible YAML inventory: groups, host ranges, group_vars/host_vars and --limit patterns.

The result must be what `ansible-inventory` (ansible-core's `yaml` inventory plugin plus the
`host_group_vars` vars plugin) would show, so every rule below mirrors ansible-core; the
equivalence tests in tests/test_inventory_ansible.py run the real ansible-inventory to prove it.

Variables are loaded and layered, never templated (Jinja stays literal).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.groups import BUILTIN_GROUPS, GroupBuilder
from ernie_deploy.inventory.patterns import PatternMatcher
from ernie_deploy.inventory.yamlfile import load_yaml, plain, to_json, type_name
from ernie_deploy.planning.bulk import collector_paused

# Names ansible-inventory strips from its output (ansible.constants.INTERNAL_STATIC_VARS): magic
# variables such as inventory_hostname, and anything a user sets under one of these names.
INTERNAL_VARS = frozenset({
    "ansible_async_path", "ansible_collection_name", "ansible_config_file", "ansible_dependent_role_names",
    "ansible_diff_mode", "ansible_facts", "ansible_forks", "ansible_inventory_sources", "ansible_limit",
    "ansible_play_batch", "ansible_play_hosts", "ansible_play_hosts_all", "ansible_play_role_names",
    "ansible_playbook_python", "ansible_role_name", "ansible_role_names", "ansible_run_tags",
    "ansible_skip_tags", "ansible_verbosity", "ansible_version", "group_names", "groups", "hostvars",
    "inventory_dir", "inventory_file", "inventory_hostname", "inventory_hostname_short", "play_hosts",
    "playbook_dir", "role_name", "role_names", "role_path", "role_uuid",
})
# Ansible tries NAME with no extension first (so a NAME/ directory wins), then these, first hit only.
VARS_EXTENSIONS = ("", ".yml", ".yaml", ".json")


@dataclass(frozen=True)
class Host:
    name: str
    # Effective variables after Ansible's precedence, as `ansible-inventory --host NAME` shows them.
    vars: Mapping[str, Any] = field(hash=False)
    groups: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        value = self.vars.get("ansible_host", self.name)
        if not isinstance(value, str) or not value:
            raise InventoryError(f"ansible_host must be a non-empty string, got {value!r}", where=self.name,
                                 hint="set ansible_host to the host's DNS name or IP address")
        return value

    @property
    def port(self) -> int:
        value = self.vars.get("ansible_port", 22)
        if isinstance(value, str) and value.isdigit():
            value = int(value)  # Ansible's ssh connection accepts a quoted number too
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise InventoryError(f"ansible_port must be an integer 1..65535, got {value!r}", where=self.name,
                                 hint="set ansible_port to the SSH port number, e.g. 22")
        return value

    @property
    def user(self) -> str | None:
        value = self.vars.get("ansible_user")
        if value is not None and (not isinstance(value, str) or not value):
            raise InventoryError(f"ansible_user must be a non-empty string, got {value!r}", where=self.name,
                                 hint="set ansible_user to the SSH login name")
        return value


class Inventory:
    """A loaded inventory. `hosts` is in Ansible's order for the `all` pattern."""

    def __init__(self, path: Path, shown: str, builder: GroupBuilder) -> None:
        self.path = path
        self._shown = shown
        self._groups = builder.groups
        self._host_inv_vars = builder.host_vars
        # group_vars/ and host_vars/ are looked up beside the real location of the inventory's directory.
        self._basedir = Path(os.path.realpath(path.absolute().parent))
        self._file_vars_cache: dict[tuple[str, str], dict[str, Any]] = {}
        self._vars_dirs: dict[str, bool] = {}
        self._depth: dict[str, int] = {}
        self._matcher = PatternMatcher(list(self._groups), list(self._host_inv_vars), self._group_hosts)
        self.hosts: dict[str, Host] = {}
        for name in self._group_hosts("all"):
            member_of = builder.member_of(name)
            self.hosts[name] = Host(
                name=name,
                vars=MappingProxyType(self._effective_vars(name, member_of)),
                groups=tuple(sorted(member_of - set(BUILTIN_GROUPS))),
            )

    # -- precedence ---------------------------------------------------------------------------

    def _depth_of(self, group: str) -> int:
        """Longest path from `all`: the depth ansible-core maintains while linking groups."""
        if group not in self._depth:
            parents = self._groups[group].parents
            self._depth[group] = max((self._depth_of(p) + 1 for p in parents), default=0)
        return self._depth[group]

    def _effective_vars(self, host: str, member_of: set[str]) -> dict[str, Any]:
        """Layer variables in ansible-core's order (VariableManager.get_vars, default precedence).

        Inventory-file vars of `all`, then of every group of the host (shallow first, then by
        ansible_group_priority, then by name), then group_vars/all, then group_vars/<group> in that
        same group order, then the host's inventory-file vars, then host_vars/<host>. Each layer
        replaces whole top-level values (hash_behaviour=replace): dicts are not merged.
        """
        ordered = sorted(member_of - {"all"}, key=lambda g: (self._depth_of(g), self._groups[g].priority, g))
        layers = [self._groups["all"].vars, *(self._groups[g].vars for g in ordered)]
        layers += [self._file_vars("group_vars", "all"), *(self._file_vars("group_vars", g) for g in ordered)]
        layers += [self._host_inv_vars[host], self._file_vars("host_vars", host)]
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer)
        return {k: copy.deepcopy(v) for k, v in merged.items() if k not in INTERNAL_VARS}

    def _group_vars_for_display(self, group: str) -> dict[str, Any]:
        """What ansible-inventory shows as a group's own vars (--graph --vars)."""
        found = {**self._groups[group].vars, **self._file_vars("group_vars", group)}
        if self._groups[group].priority != 1:
            found["ansible_group_priority"] = self._groups[group].priority
        return {k: v for k, v in found.items() if k not in INTERNAL_VARS}

    # -- group_vars/ and host_vars/ ----------------------------------------------------------------

    def _file_vars(self, subdir: str, name: str) -> dict[str, Any]:
        key = (subdir, name)
        if key not in self._file_vars_cache:
            merged: dict[str, Any] = {}
            for file in self._vars_files(subdir, name):
                merged.update(self._read_vars_file(file))
            self._file_vars_cache[key] = merged
        return self._file_vars_cache[key]

    def _vars_files(self, subdir: str, name: str) -> list[Path]:
        base = self._basedir / subdir
        if subdir not in self._vars_dirs:
            self._vars_dirs[subdir] = base.is_dir()  # asked once per host: a stat each adds up in big fleets
        if name.startswith(os.sep) or not self._vars_dirs[subdir]:
            return []  # Ansible skips chroot-like names such as /path/to/root
        for ext in VARS_EXTENSIONS:
            candidate = base / f"{name}{ext}"
            if candidate.exists():
                return _files_in_dir(candidate) if candidate.is_dir() else [candidate]
        return []

    def _read_vars_file(self, file: Path) -> dict[str, Any]:
        shown = str(Path(self._shown).parent / file.relative_to(self._basedir))
        data = load_yaml(file, shown)
        if not data:
            return {}  # empty files are ignored, as in Ansible
        if not isinstance(data, dict):
            raise InventoryError(f"a vars file must be a mapping of variables, got {type_name(data)}",
                                 where=f"{shown}:1", hint="write `name: value` lines at the top level")
        for var in data:
            if not isinstance(var, str) or not var:
                raise InventoryError(f"variable name must be a string, got {var!r}",
                                     where=f"{shown}:{GroupBuilder.line(data, var)}", hint="quote the name")
        return {var: plain(value) for var, value in data.items()}

    # -- queries ---------------------------------------------------------------------------

    def _group_hosts(self, group: str) -> list[str]:
        """Hosts of a group and its descendants in Ansible's order (Group.get_hosts).

        Ansible walks the group's children level by level; within deeper levels it iterates a set,
        whose order we fix to the order the groups were linked.
        """
        ordered = [group, *self._groups[group].children]
        seen: set[str] = set()
        level = list(dict.fromkeys(ordered))
        while level:
            seen.update(level)
            below = [c for g in level for c in self._groups[g].children if c not in seen]
            ordered.extend(below)
            level = list(dict.fromkeys(below))
        return list(dict.fromkeys(h for g in ordered for h in self._groups[g].hosts))

    def select(self, pattern: str | None) -> list[Host]:
        """Hosts matching an Ansible host pattern (`--limit`), in Ansible's order."""
        if pattern is None or pattern.strip() in ("", "all", "*"):
            return list(self.hosts.values())
        names = self._matcher.evaluate(pattern)
        if not names:
            unmatched = self._matcher.unmatched_terms(pattern)
            detail = f" ({', '.join(repr(t) for t in unmatched)} matches no group or host)" if unmatched else ""
            groups = ", ".join(sorted(g for g in self._groups if g not in BUILTIN_GROUPS)) or "(none)"
            raise InventoryError(f"host pattern '{pattern}' matches no hosts{detail}", where=self._shown,
                                 hint=f"use a host name, a glob, or one of the groups: {groups}")
        return [self.hosts[name] for name in names]

    def ansible_list(self) -> dict[str, Any]:
        """The JSON document `ansible-inventory -i FILE --list` prints (ansible-core 2.19 shape)."""
        result: dict[str, Any] = {}
        for group in self._groups.values():
            entry: dict[str, Any] = {}
            if group.name != "all" and group.hosts:
                entry["hosts"] = list(group.hosts)
            if group.children:
                entry["children"] = list(group.children)
            if entry:  # ansible-inventory drops empty keys and then empty groups
                result[group.name] = entry
        hostvars = {name: to_json(dict(host.vars)) for name, host in self.hosts.items() if host.vars}
        result["_meta"] = {"hostvars": hostvars, "profile": "inventory_legacy"}
        return result

    def ansible_host(self, name: str) -> dict[str, Any]:
        """The JSON document `ansible-inventory -i FILE --host NAME` prints."""
        if name not in self.hosts:
            raise InventoryError(f"no host named '{name}' in the inventory", where=self._shown,
                                 hint="pass a host name exactly as `ansible-inventory --list` shows it")
        # Unlike --list, --host prints `!unsafe` strings as plain strings.
        return dict(to_json(dict(self.hosts[name].vars), mark_unsafe=False))

    def graph(self, group: str = "all", with_vars: bool = False) -> str:
        """The text `ansible-inventory -i FILE --graph [GROUP] [--vars]` prints."""
        if group not in self._groups:
            raise InventoryError(f"no group named '{group}' in the inventory", where=self._shown,
                                 hint=f"pick one of: {', '.join(self._groups)}")
        return "\n".join(self._graph_lines(group, 0, with_vars))

    def _graph_lines(self, group: str, depth: int, with_vars: bool) -> list[str]:
        lines = [_graph_item(f"@{group}:", depth)]
        for child in self._groups[group].children:
            lines.extend(self._graph_lines(child, depth + 1, with_vars))
        if group != "all":  # ansible-inventory lists hosts under their groups, never under `all`
            for host in self._groups[group].hosts:
                lines.append(_graph_item(host, depth + 1))
                if with_vars:
                    lines.extend(_graph_vars(self.hosts[host].vars, depth + 2))
        if with_vars:
            lines.extend(_graph_vars(self._group_vars_for_display(group), depth + 1))
        return lines


def _graph_item(text: str, depth: int) -> str:
    return "  |" * depth + f"--{text}" if depth else text


def _graph_vars(variables: Mapping[str, Any], depth: int) -> list[str]:
    return [_graph_item(f"{{{name} = {value}}}", depth) for name, value in sorted(variables.items())]


def _files_in_dir(directory: Path) -> list[Path]:
    """Files of a group_vars/NAME/ directory in Ansible's order: sorted names, recursing in place."""
    found: list[Path] = []
    for entry in sorted(os.listdir(directory)):
        if entry.startswith(".") or entry.endswith("~"):
            continue  # hidden files and editor backups
        full, ext = directory / entry, os.path.splitext(entry)[1]
        if full.is_dir() and not ext:
            found.extend(_files_in_dir(full))
        elif full.is_file() and (not ext or ext in VARS_EXTENSIONS):
            found.append(full)
    return found


def load_inventory(path: str | Path) -> Inventory:
    """Load a YAML inventory file with its group_vars/ and host_vars/ directories."""
    path = Path(path)
    shown = str(path)
    if not path.is_file():
        raise InventoryError("inventory file not found", where=shown,
                             hint="pass the path of a YAML inventory file (e.g. inventory.yml)")
    with collector_paused():
        builder = GroupBuilder(shown)
        builder.parse_document(load_yaml(path, shown))
        builder.reconcile()
        return Inventory(path, shown, builder)
