"""Unit tests for the YAML inventory: ranges, groups, precedence, vars files, patterns, errors, hosts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.inventory import Host, Inventory, load_inventory
from ernie_deploy.inventory.patterns import expand_host_key, split_pattern


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def inv(tmp_path: Path, text: str, **files: str) -> Inventory:
    """Load inventory.yml from `text`; keyword files are written as group_vars__x.yml -> group_vars/x.yml."""
    for rel, body in files.items():
        write(tmp_path, rel.replace("__", "/"), body)
    return load_inventory(write(tmp_path, "inventory.yml", text))


def names(hosts: list[Host]) -> list[str]:
    return [h.name for h in hosts]


# -- ranges ---------------------------------------------------------------------------------------


def test_numeric_range_keeps_zero_padding(tmp_path: Path) -> None:
    i = inv(tmp_path, "all:\n  hosts:\n    gpu-a10-[01:04].dc1:\n")
    assert list(i.hosts) == [f"gpu-a10-0{n}.dc1" for n in range(1, 5)]


@pytest.mark.parametrize(("key", "expected"), [
    ("node-[a:c]", ["node-a", "node-b", "node-c"]),
    ("n[1:10:3]", ["n1", "n4", "n7", "n10"]),
    ("r[1:2]-s[08:09]", ["r1-s08", "r1-s09", "r2-s08", "r2-s09"]),
    ("plain.example", ["plain.example"]),
    ("n[:2]", ["n0", "n1", "n2"]),
])
def test_range_expansion(key: str, expected: list[str]) -> None:
    assert expand_host_key(key) == (expected, None)


def test_host_key_port_sets_ansible_port(tmp_path: Path) -> None:
    i = inv(tmp_path, "all:\n  hosts:\n    'web[1:2]:2222':\n    '[fe80::1]:2200':\n")
    assert {n: h.port for n, h in i.hosts.items()} == {"web1": 2222, "web2": 2222, "fe80::1": 2200}


@pytest.mark.parametrize("key", ["n[01:4]", "n[c:a]", "n[1]", "n[1:]"])
def test_bad_range_names_file_line_and_key(tmp_path: Path, key: str) -> None:
    with pytest.raises(InventoryError) as err:
        inv(tmp_path, f"all:\n  children:\n    g:\n      hosts:\n        '{key}':\n")
    assert err.value.where == f"{tmp_path / 'inventory.yml'}:5: all.children.g.hosts.{key}"
    assert "range" in err.value.message


# -- groups ---------------------------------------------------------------------------------------

NESTED = """\
all:
  hosts:
    lone:
  children:
    gpus:
      children:
        a10:
          hosts:
            g1:
        h100:
          hosts:
            g2:
    east:
      children:
        a10:
"""


def test_nested_groups_and_ancestors(tmp_path: Path) -> None:
    i = inv(tmp_path, NESTED)
    assert i.hosts["g1"].groups == ("a10", "east", "gpus")
    assert i.hosts["g2"].groups == ("gpus", "h100")
    assert i.hosts["lone"].groups == ()  # only in all/ungrouped, both excluded
    assert names(i.select("gpus")) == ["g1", "g2"]
    assert names(i.select("east")) == ["g1"]


def test_list_shape(tmp_path: Path) -> None:
    listing = inv(tmp_path, NESTED + "    empty:\n").ansible_list()
    assert listing["all"] == {"children": ["ungrouped", "gpus", "east", "empty"]}
    assert listing["ungrouped"] == {"hosts": ["lone"]}
    assert listing["gpus"] == {"children": ["a10", "h100"]}
    assert "empty" not in listing  # ansible-inventory drops groups with neither hosts nor children
    assert listing["_meta"] == {"hostvars": {}, "profile": "inventory_legacy"}


def test_graph_text(tmp_path: Path) -> None:
    i = inv(tmp_path, "all:\n  vars: {x: 1}\n  children:\n    g:\n      hosts:\n        h: {y: [1]}\n")
    assert i.graph() == "@all:\n  |--@ungrouped:\n  |--@g:\n  |  |--h"
    assert i.graph("g", with_vars=True) == "@g:\n  |--h\n  |  |--{x = 1}\n  |  |--{y = [1]}"
    with pytest.raises(InventoryError, match="no group named 'nope'"):
        i.graph("nope")


def test_group_loop_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="loop") as err:
        inv(tmp_path, "a:\n  children:\n    b:\n      children:\n        a:\n")
    # b's children are linked first (as in Ansible), so closing the loop is linking b under a.
    assert err.value.where.endswith(":3: a.children.b")


def test_empty_file_is_an_empty_inventory(tmp_path: Path) -> None:
    i = inv(tmp_path, "")
    assert i.hosts == {}
    assert i.select(None) == []
    assert i.ansible_list()["all"] == {"children": ["ungrouped"]}


# -- precedence -----------------------------------------------------------------------------------

LADDER = """\
all:
  vars: {v: all, only_all: 1}
  children:
    parent:
      vars: {v: parent}
      children:
        child:
          vars: {v: child}
          hosts:
            h:
"""


def test_inventory_group_vars_child_beats_parent_beats_all(tmp_path: Path) -> None:
    assert inv(tmp_path, LADDER).hosts["h"].vars == {"v": "child", "only_all": 1}


def test_group_vars_all_file_beats_inventory_group_vars(tmp_path: Path) -> None:
    # ansible-core layers group_vars/all above every group's inventory-file vars.
    i = inv(tmp_path, LADDER, group_vars__all="v: file-all\n")
    assert i.hosts["h"].vars["v"] == "file-all"


def test_group_vars_group_file_beats_group_vars_all(tmp_path: Path) -> None:
    i = inv(tmp_path, LADDER, group_vars__all="v: file-all\n", group_vars__parent="v: file-parent\n")
    assert i.hosts["h"].vars["v"] == "file-parent"


def test_inventory_host_vars_beat_group_files_and_host_vars_file_beats_all(tmp_path: Path) -> None:
    text = LADDER.replace("            h:\n", "            h: {v: host}\n            k: {v: host}\n")
    i = inv(tmp_path, text, group_vars__child="v: file-child\n", host_vars__k="v: host-file\n")
    assert i.hosts["h"].vars["v"] == "host"
    assert i.hosts["k"].vars["v"] == "host-file"


def test_siblings_merge_by_name_and_priority_overrides(tmp_path: Path) -> None:
    text = """\
    all:
      children:
        b: {vars: {v: b}, hosts: {h1: , h2: }}
        a: {vars: {v: a}, hosts: {h1: , h2: }}
        c: {vars: {v: c, ansible_group_priority: 0}, hosts: {h2: }}
    """
    i = inv(tmp_path, text, group_vars__a="ansible_group_priority: 99\n")
    assert i.hosts["h1"].vars["v"] == "b"  # same depth and priority: the later name wins
    assert i.hosts["h2"].vars["v"] == "b"  # c's lower priority sorts it first, despite its name
    # A priority in group_vars/ is an ordinary variable (it did not make `a` win above);
    # c's inventory priority is not a variable at all.
    assert i.hosts["h2"].vars["ansible_group_priority"] == 99


def test_dicts_are_replaced_not_merged(tmp_path: Path) -> None:
    text = "all:\n  vars:\n    env: {A: 1, B: 2}\n  hosts:\n    h:\n      env: {C: 3}\n    k:\n"
    i = inv(tmp_path, text, host_vars__k="env: {D: 4}\n")
    assert i.hosts["h"].vars["env"] == {"C": 3}
    assert i.hosts["k"].vars["env"] == {"D": 4}


def test_values_keep_yaml_types_and_are_not_templated(tmp_path: Path) -> None:
    text = "all:\n  hosts:\n    h:\n      n: 8\n      f: 0.9\n      b: true\n      s: '{{ n }}'\n      l: [1, x]\n"
    assert dict(inv(tmp_path, text).hosts["h"].vars) == {"n": 8, "f": 0.9, "b": True, "s": "{{ n }}",
                                                         "l": [1, "x"]}


def test_host_vars_are_read_only(tmp_path: Path) -> None:
    host = inv(tmp_path, "all:\n  hosts:\n    h: {a: 1}\n").hosts["h"]
    with pytest.raises(TypeError):
        host.vars["a"] = 2  # type: ignore[index]


# -- group_vars/ and host_vars/ files ------------------------------------------------------------


def test_group_vars_directory_merges_files_in_sorted_order(tmp_path: Path) -> None:
    i = inv(tmp_path, "g:\n  hosts:\n    h:\n",
            group_vars__g__b_second="v: second\nb: 1\n", group_vars__g__a_first="v: first\na: 1\n",
            **{"group_vars__g__c.json": '{"c": [1, 2]}', "group_vars__g__.hidden.yml": "v: hidden\n",
               "group_vars__g__d.txt": "v: txt\n", "group_vars__g__e.yml~": "v: backup\n"})
    assert dict(i.hosts["h"].vars) == {"v": "second", "a": 1, "b": 1, "c": [1, 2]}


def test_vars_file_extension_order(tmp_path: Path) -> None:
    files = {"group_vars__g.yml": "v: yml\n", "group_vars__g.yaml": "v: yaml\nextra: 1\n",
             "host_vars__h": "hv: no-extension\n", "host_vars__h.yml": "hv: ignored\n"}
    i = inv(tmp_path, "g:\n  hosts:\n    h:\n", **files)
    assert dict(i.hosts["h"].vars) == {"v": "yml", "hv": "no-extension"}


def test_vars_file_that_is_not_a_mapping_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="must be a mapping") as err:
        inv(tmp_path, "g:\n  hosts:\n    h:\n", **{"group_vars__g.yml": "- a\n- b\n"})
    assert err.value.where == f"{tmp_path / 'group_vars' / 'g.yml'}:1"


def test_vars_file_yaml_error_names_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="invalid YAML") as err:
        inv(tmp_path, "g:\n  hosts:\n    h:\n", **{"host_vars__h.yml": "a: 1\nb: [unclosed\n"})
    assert err.value.where.startswith(f"{tmp_path / 'host_vars' / 'h.yml'}:")


# -- patterns -------------------------------------------------------------------------------------

PATTERNS = """\
all:
  children:
    a10:
      hosts: {gpu-a10-01: , gpu-a10-02: , both-1: }
    h100:
      hosts: {gpu-h100-01: , both-1: }
    east:
      hosts: {gpu-a10-02: , gpu-h100-01: }
"""


@pytest.mark.parametrize(("pattern", "expected"), [
    ("gpu-a10-02", ["gpu-a10-02"]),                                    # host name
    ("h100", ["gpu-h100-01", "both-1"]),                               # group name
    ("gpu-a10-*", ["gpu-a10-01", "gpu-a10-02"]),                       # glob
    ("~gpu-(a10-01|h100)", ["gpu-a10-01", "gpu-h100-01"]),             # regex, matched from the start
    ("h100:east", ["gpu-h100-01", "both-1", "gpu-a10-02"]),            # union with ':'
    ("east,h100", ["gpu-a10-02", "gpu-h100-01", "both-1"]),            # union with ','
    ("a10:&east", ["gpu-a10-02"]),                                     # intersection
    ("a10:!east", ["gpu-a10-01", "both-1"]),                           # exclusion
    ("!east:a10", ["gpu-a10-01", "both-1"]),                           # exclusions apply last
    ("&h100:a10:east", ["both-1", "gpu-h100-01"]),                     # intersections after unions
    ("!a10", ["gpu-h100-01"]),                                         # no union term means all
    ("a10[1:]", ["gpu-a10-02", "both-1"]),                             # subscript
    (None, ["gpu-a10-01", "gpu-a10-02", "both-1", "gpu-h100-01"]),
    ("*", ["gpu-a10-01", "gpu-a10-02", "both-1", "gpu-h100-01"]),
])
def test_pattern_operators(tmp_path: Path, pattern: str | None, expected: list[str]) -> None:
    assert names(inv(tmp_path, PATTERNS).select(pattern)) == expected


def test_split_pattern_keeps_ranges_and_addresses_whole() -> None:
    assert split_pattern("web[1:3]") == ["web[1:3]"]
    assert split_pattern("a:b[1:2]:&c") == ["a", "b[1:2]", "&c"]
    assert split_pattern(" a , !b ") == ["a", "!b"]


def test_pattern_matching_nothing_names_pattern_and_groups(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as err:
        inv(tmp_path, PATTERNS).select("gpu-b200-*")
    assert "'gpu-b200-*'" in err.value.message
    assert err.value.hint is not None and "a10, east, h100" in err.value.hint


def test_empty_intersection_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="matches no hosts"):
        inv(tmp_path, PATTERNS).select("east:&a10:!gpu-a10-02")


def test_invalid_regex_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="invalid host pattern"):
        inv(tmp_path, PATTERNS).select("~gpu-(")


# -- structural errors ----------------------------------------------------------------------------


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="invalid YAML") as err:
        inv(tmp_path, "all:\n  hosts:\n    h1:\n   bad: [\n")
    assert err.value.where.startswith(f"{tmp_path / 'inventory.yml'}:")
    assert err.value.where.split(":")[-1].isdigit()


@pytest.mark.parametrize(("text", "where", "message"), [
    ("all:\n  children:\n    a10:\n      hosts:\n        - h1\n",
     ":4: all.children.a10.hosts", "'hosts' of group 'a10' must be a mapping, got a list"),
    ("all:\n  vars: oops\n", ":2: all.vars", "'vars' of group 'all' must be a mapping, got a string"),
    ("all:\n  children: [a, b]\n", ":2: all.children", "'children' of group 'all' must be a mapping"),
    ("all:\n  hosts:\n    h1: [x]\n", ":3: all.hosts.h1", "host 'h1' must map to its variables"),
    ("all:\n  hosts:\n    h1: yes\n", ":3: all.hosts.h1", "got bool"),
    ("all:\n  children:\n    g:\n      host:\n        h1:\n",
     ":4: all.children.g.host", "unexpected key 'host' in group 'g'"),
    ("all:\n  children:\n    g: [h1]\n", ":3: all.children.g", "group 'g' must be a mapping"),
    ("all:\n  hosts:\n    123:\n", ":3: all.hosts.123", "host name must be a string"),
    ("all:\n  children:\n    g:\n      vars: {ansible_group_priority: high}\n",
     ":4: all.children.g.vars", "ansible_group_priority must be an integer"),
    # Read by ansible-inventory (cli/inventories.py); the bundled reader names what to install.
    ("plugin: aws_ec2\n", "", "an inventory plugin configuration (aws_ec2)"),
])
def test_wrong_types_name_file_line_and_key_path(tmp_path: Path, text: str, where: str, message: str) -> None:
    with pytest.raises(InventoryError) as err:
        inv(tmp_path, text)
    assert err.value.where == f"{tmp_path / 'inventory.yml'}{where}"
    assert message in err.value.message


def test_top_level_list_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="mapping of groups, got a list"):
        inv(tmp_path, "- h1\n- h2\n")


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="not found"):
        load_inventory(tmp_path / "nope.yml")


# -- Host -----------------------------------------------------------------------------------------


def test_host_connection_defaults_and_overrides(tmp_path: Path) -> None:
    text = "all:\n  hosts:\n    plain:\n    set: {ansible_host: 10.0.0.5, ansible_port: 2222, ansible_user: ops}\n"
    i = inv(tmp_path, text)
    assert (i.hosts["plain"].address, i.hosts["plain"].port, i.hosts["plain"].user) == ("plain", 22, None)
    assert (i.hosts["set"].address, i.hosts["set"].port, i.hosts["set"].user) == ("10.0.0.5", 2222, "ops")


@pytest.mark.parametrize("port", ["0", "65536", "abc", "true", "[22]"])
def test_invalid_port_names_the_host(tmp_path: Path, port: str) -> None:
    host = inv(tmp_path, f"all:\n  hosts:\n    h9: {{ansible_port: {port}}}\n").hosts["h9"]
    with pytest.raises(InventoryError, match="ansible_port") as err:
        _ = host.port
    assert err.value.where == "h9"


def test_quoted_port_is_accepted(tmp_path: Path) -> None:
    assert inv(tmp_path, "all:\n  hosts:\n    h: {ansible_port: '2022'}\n").hosts["h"].port == 2022


@pytest.mark.parametrize(("var", "prop"), [("ansible_user", "user"), ("ansible_host", "address")])
def test_non_string_user_or_address_names_the_host(tmp_path: Path, var: str, prop: str) -> None:
    host = inv(tmp_path, f"all:\n  hosts:\n    h: {{{var}: 42}}\n").hosts["h"]
    with pytest.raises(InventoryError, match=var) as err:
        getattr(host, prop)
    assert err.value.where == "h"


def test_ansible_host_output_and_unknown_host(tmp_path: Path) -> None:
    i = inv(tmp_path, "all:\n  vars: {inventory_hostname: x, a: 1}\n  hosts:\n    h:\n")
    assert i.ansible_host("h") == {"a": 1}  # magic/internal names are stripped, as ansible-inventory does
    with pytest.raises(InventoryError, match="no host named 'zz'"):
        i.ansible_host("zz")
