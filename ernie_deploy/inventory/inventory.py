"""Ansible-compatible YAML inventory: groups, host ranges, group_vars/host_vars and --limit patterns.

The result must be what `ansible-inventory` (ansible-core's `yaml` inventory plugin plus the
`host_group_vars` vars plugin) would show, so every rule below mirrors ansible-core; the
equivalence tests in tests/test_inventory_ansible.py run the real ansible-inventory to prove it.

Variables are loaded and layered, never templated (Jinja stays literal).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.groups import BUILTIN_GROUPS, Group, GroupBuilder
from ernie_deploy.inventory.patterns import PatternMatcher
from ernie_deploy.inventory.sources import Source, classify
from ernie_deploy.inventory.yamlfile import Decrypt, load_yaml, plain, to_json, type_name
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
INSTALL_ANSIBLE = ("install ansible-core on the controller (`pip install ansible-core`, or your distribution's "
                   "ansible-core package): ernie-deploy reads such sources through its ansible-inventory")
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


class VarLayers(Protocol):
    """Where a host's variables come from: the bundled reader's files, or ansible-inventory's output."""

    def host_vars(self, host: str, ordered_groups: list[str]) -> dict[str, Any]: ...

    def group_vars(self, group: str) -> dict[str, Any]: ...

    def origin(self, host: str, var: str, ordered_groups: list[str]) -> str: ...


class Inventory:
    """A loaded inventory. `hosts` is in Ansible's order for the `all` pattern."""

    def __init__(self, shown: str, groups: dict[str, Group], memberships: Mapping[str, set[str]],
                 layers: VarLayers) -> None:
        self._shown = shown
        self._groups = groups
        self._layers = layers
        self._depth: dict[str, int] = {}
        self._matcher = PatternMatcher(list(self._groups), list(memberships), self._group_hosts)
        self._memberships = memberships
        self._redact: Callable[[Mapping[str, Any]], dict[str, Any]] = dict
        self.hosts: dict[str, Host] = {}
        for name in self._group_hosts("all"):
            member_of = memberships[name]
            ordered = self._ordered(member_of)
            variables = {k: copy.deepcopy(v) for k, v in layers.host_vars(name, ordered).items()
                         if k not in INTERNAL_VARS}
            self.hosts[name] = Host(name=name, vars=MappingProxyType(variables),
                                    groups=tuple(sorted(member_of - set(BUILTIN_GROUPS))))

    @property
    def shown(self) -> str:
        """The sources as the user named them, for messages."""
        return self._shown

    def origin(self, host: str, var: str) -> str:
        """The file a host's variable comes from (its last definition), for messages."""
        return self._layers.origin(host, var, self._ordered(self._memberships[host]))

    def group_members(self) -> dict[str, list[str]]:
        """Each group's hosts (its own and its descendants'), as Jinja's `groups` sees them."""
        return {name: self._group_hosts(name) for name in self._groups}

    def redacted(self, redact: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Inventory:
        """The same inventory for display: every host's and group's variables passed through `redact`."""
        other = self.replace_hosts({n: Host(n, redact(h.vars), h.groups) for n, h in self.hosts.items()})
        other._redact = redact
        return other

    def replace_hosts(self, hosts: Mapping[str, Host]) -> Inventory:
        """The same tree with these hosts (the ones whose variables were resolved)."""
        other = copy.copy(self)
        other.hosts = dict(hosts)
        return other

    # -- precedence ---------------------------------------------------------------------------

    def _depth_of(self, group: str) -> int:
        """Longest path from `all`: the depth ansible-core maintains while linking groups."""
        if group not in self._depth:
            parents = self._groups[group].parents
            self._depth[group] = max((self._depth_of(p) + 1 for p in parents), default=0)
        return self._depth[group]

    def _ordered(self, member_of: set[str]) -> list[str]:
        """A host's groups in precedence order: shallow first, then by ansible_group_priority, then by name."""
        return sorted(member_of - {"all"}, key=lambda g: (self._depth_of(g), self._groups[g].priority, g))

    def _group_vars_for_display(self, group: str) -> dict[str, Any]:
        """What ansible-inventory shows as a group's own vars (--graph --vars)."""
        found = self._redact(self._layers.group_vars(group))
        if self._groups[group].priority != 1:
            found["ansible_group_priority"] = self._groups[group].priority
        return {k: v for k, v in found.items() if k not in INTERNAL_VARS}


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

    def ansible_tree(self) -> dict[str, Any]:
        """The groups as a YAML inventory writes them: each group with its hosts and children, no variables."""
        tree: dict[str, Any] = {}
        for group in self._groups.values():
            entry: dict[str, Any] = {}
            if group.children:
                entry["children"] = dict.fromkeys(group.children)
            if group.name != "all" and group.hosts:
                entry["hosts"] = dict.fromkeys(group.hosts)
            if entry:
                tree[group.name] = entry
        return tree

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


class FileLayers:
    """Variables layered in ansible-core's order (VariableManager.get_vars, default precedence) from YAML
    inventory files and the group_vars/ and host_vars/ beside each source.

    Inventory-file vars of `all`, then of every group of the host (shallow first, then by ansible_group_priority,
    then by name), then group_vars/all of each source in turn, then group_vars/<group> in that same group order,
    source after source, then the host's inventory-file vars, then host_vars/<host> of each source. Each layer
    replaces whole top-level values (hash_behaviour=replace): dicts are not merged.
    """

    def __init__(self, builder: GroupBuilder, sources: Sequence[Source], decrypt: Decrypt | None) -> None:
        self._builder = builder
        # (base directory, how to show it): group_vars/ and host_vars/ are looked up beside each source.
        self._bases = [(s.basedir, str(Path(s.given) if Path(s.given).is_dir() else Path(s.given).parent))
                       for s in sources]
        self._decrypt = decrypt
        self._file_vars_cache: dict[tuple[int, str, str], tuple[dict[str, Any], dict[str, str]]] = {}
        self._vars_dirs: dict[tuple[int, str], bool] = {}

    def _sequence(self, host: str, ordered: list[str]) -> list[tuple[Mapping[str, Any], Mapping[str, str] | str]]:
        """The layers of a host's variables, lowest precedence first, each with where its variables come from
        (a file for every variable, or one per variable)."""
        groups, bases = self._builder.groups, range(len(self._bases))
        found: list[tuple[Mapping[str, Any], Mapping[str, str] | str]] = []
        found += [(groups[g].vars, groups[g].origins) for g in ("all", *ordered)]
        # group_vars/all of each source, then each source's group_vars/<group> (get_vars_from_inventory_sources
        # walks the sources outside, the groups inside).
        found += [self._file_layer(i, "group_vars", "all") for i in bases]
        found += [self._file_layer(i, "group_vars", g) for i in bases for g in ordered]
        found.append((self._builder.host_vars[host], self._builder.host_files.get(host, "") + f", host {host}"))
        found += [self._file_layer(i, "host_vars", host) for i in bases]
        return found

    def host_vars(self, host: str, ordered_groups: list[str]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for layer, _ in self._sequence(host, ordered_groups):
            merged.update(layer)
        return merged

    def group_vars(self, group: str) -> dict[str, Any]:
        found = dict(self._builder.groups[group].vars)
        for i in range(len(self._bases)):
            found.update(self._file_layer(i, "group_vars", group)[0])
        return found

    def origin(self, host: str, var: str, ordered_groups: list[str]) -> str:
        for layer, where in reversed(self._sequence(host, ordered_groups)):
            if var in layer:
                return where if isinstance(where, str) else where.get(var, "")
        return ""

    def _file_layer(self, base: int, subdir: str, name: str) -> tuple[dict[str, Any], dict[str, str]]:
        key = (base, subdir, name)
        if key not in self._file_vars_cache:
            merged: dict[str, Any] = {}
            where: dict[str, str] = {}
            for file in self._vars_files(base, subdir, name):
                shown = str(Path(self._bases[base][1]) / file.relative_to(self._bases[base][0]))
                layer = self._read_vars_file(file, shown)
                merged.update(layer)
                where.update(dict.fromkeys(layer, f"{shown}, {'group' if subdir == 'group_vars' else 'host'} {name}"))
            self._file_vars_cache[key] = (merged, where)
        return self._file_vars_cache[key]

    def _vars_files(self, base: int, subdir: str, name: str) -> list[Path]:
        directory = self._bases[base][0] / subdir
        if (base, subdir) not in self._vars_dirs:
            self._vars_dirs[(base, subdir)] = directory.is_dir()  # asked once per host: a stat each adds up
        if name.startswith(os.sep) or not self._vars_dirs[(base, subdir)]:
            return []  # Ansible skips chroot-like names such as /path/to/root
        for ext in VARS_EXTENSIONS:
            candidate = directory / f"{name}{ext}"
            if candidate.exists():
                return _files_in_dir(candidate) if candidate.is_dir() else [candidate]
        return []

    def _read_vars_file(self, file: Path, shown: str) -> dict[str, Any]:
        data = load_yaml(file, shown, self._decrypt)
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


def load_inventory(paths: str | Path | Sequence[str | Path], decrypt: Decrypt | None = None) -> Inventory:
    """Load YAML inventory sources (files or directories of them) with the group_vars/ and host_vars/ beside
    each, merged in the order given as ansible-core merges repeated `-i`. Any other kind of source is an error
    naming what reads it (cli/inventories.py sends such sources to ansible-inventory instead)."""
    given = [str(paths)] if isinstance(paths, (str, Path)) else [str(p) for p in paths]
    return load_sources([classify(g) for g in given], decrypt)


def load_sources(sources: Sequence[Source], decrypt: Decrypt | None = None) -> Inventory:
    """load_inventory of sources classified already (inventory/sources.py), so no file is read twice to
    decide."""
    for source in sources:
        if source.foreign == "missing":
            raise InventoryError("inventory source not found", where=source.given,
                                 hint="pass an inventory file or directory (e.g. -i inventory.yml)")
        if source.foreign:
            raise InventoryError(f"{source.foreign}: the bundled reader reads YAML inventories only",
                                 where=source.foreign_path, hint=INSTALL_ANSIBLE)
    shown = ", ".join(s.given for s in sources)
    with collector_paused():
        builder = GroupBuilder(shown)
        for source in sources:
            for file in source.files:
                builder.shown = str(file) if Path(source.given).is_dir() else source.given
                builder.parse_document(load_yaml(file, builder.shown, decrypt), file=builder.shown)
        builder.shown = shown
        builder.reconcile()
        memberships = {name: builder.member_of(name) for name in builder.host_vars}
        return Inventory(shown, builder.groups, memberships, FileLayers(builder, sources, decrypt))
