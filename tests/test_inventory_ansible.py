"""Ansible-equivalence: our inventory must print exactly what ansible-core prints for the same files.

Every inventory under tests/fixtures/inventories/*/ (inventory.yml plus optional group_vars/,
host_vars/ and patterns.txt, one host pattern a line) is run through the real `ansible-inventory`
and `ansible --list-hosts`. ansible-core is a test dependency: missing tools fail, never skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.inventory import Inventory, load_inventory

FIXTURES = sorted(p for p in (Path(__file__).parent / "fixtures" / "inventories").iterdir() if p.is_dir())


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH; the Ansible-equivalence tests need ansible-core: "
                    "run `pip install -e .[test]`")
    return path


@pytest.fixture(scope="session")
def ansible_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """A clean Ansible environment: no user config, only the yaml inventory plugin, private temp dirs."""
    home = tmp_path_factory.mktemp("ansible-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        ANSIBLE_HOME=str(home),
        ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
        # Only the yaml plugin, so a file it rejects is not silently re-read as INI.
        ANSIBLE_INVENTORY_ENABLED="yaml",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_DEPRECATION_WARNINGS="false",
    )
    # The working directory is empty so no ansible.cfg or playbook-adjacent group_vars/ is picked up.
    return env, home


def _run(env: tuple[dict[str, str], Path], tool: str, inventory: Path, *args: str) -> str:
    proc = subprocess.run([_tool(tool), "-i", str(inventory.resolve()), *args], capture_output=True,
                          text=True, env=env[0], cwd=env[1], timeout=120, check=False)
    assert proc.returncode == 0, f"{tool} {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def _parallel(jobs: list[tuple[str, ...]], env: tuple[dict[str, str], Path], inventory: Path) -> list[str]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda job: _run(env, job[0], inventory, *job[1:]), jobs))


def _list_hosts(output: str) -> list[str]:
    """Parse `ansible PATTERN --list-hosts`: a `hosts (N):` line, then one host a line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    header = next(i for i, line in enumerate(lines) if line.startswith("hosts ("))
    hosts = lines[header + 1 :]
    assert lines[header] == f"hosts ({len(hosts)}):"
    return hosts


def _comparable(fixture: Path, hosts: list[str]) -> list[str]:
    """Host order as compared: exact, unless the fixture documents that Ansible's own order varies."""
    return sorted(hosts) if (fixture / "ORDER_UNSTABLE").exists() else hosts


def _patterns(fixture: Path) -> list[str]:
    file = fixture / "patterns.txt"
    return [p for p in file.read_text().splitlines() if p.strip()] if file.exists() else []


@pytest.fixture(params=FIXTURES, ids=[p.name for p in FIXTURES])
def fixture_dir(request: pytest.FixtureRequest) -> Path:
    return request.param


def _load(fixture_dir: Path) -> tuple[Path, Inventory]:
    path = fixture_dir / "inventory.yml"
    return path, load_inventory(path)


def test_enough_fixtures() -> None:
    assert len(FIXTURES) >= 6, "keep at least six inventories in tests/fixtures/inventories/"
    assert all((p / "inventory.yml").is_file() for p in FIXTURES)


def test_list_equals_ansible_inventory(fixture_dir: Path, ansible_env: tuple[dict[str, str], Path]) -> None:
    path, inventory = _load(fixture_dir)
    assert inventory.ansible_list() == json.loads(_run(ansible_env, "ansible-inventory", path, "--list"))


def test_every_host_equals_ansible_inventory(
    fixture_dir: Path, ansible_env: tuple[dict[str, str], Path]
) -> None:
    path, inventory = _load(fixture_dir)
    outputs = _parallel([("ansible-inventory", "--host", name) for name in inventory.hosts], ansible_env, path)
    for name, output in zip(inventory.hosts, outputs, strict=True):
        assert inventory.ansible_host(name) == json.loads(output), name


def test_graph_equals_ansible_inventory(fixture_dir: Path, ansible_env: tuple[dict[str, str], Path]) -> None:
    path, inventory = _load(fixture_dir)
    # One sub-graph per fixture keeps the run short; the whole graph already covers every group.
    groups = [g for g in inventory.ansible_list() if g not in ("_meta", "all", "ungrouped")][:1]
    jobs = [("ansible-inventory", "--graph"), ("ansible-inventory", "--graph", "--vars")]
    jobs += [("ansible-inventory", "--graph", "--vars", group) for group in groups]
    outputs = _parallel(jobs, ansible_env, path)
    assert inventory.graph() == outputs[0].rstrip("\n")
    assert inventory.graph(with_vars=True) == outputs[1].rstrip("\n")
    for group, output in zip(groups, outputs[2:], strict=True):
        assert inventory.graph(group, with_vars=True) == output.rstrip("\n"), group


def test_select_equals_ansible_list_hosts(fixture_dir: Path, ansible_env: tuple[dict[str, str], Path]) -> None:
    """Same hosts in the same order as `ansible -i FILE PATTERN --list-hosts` (what --limit selects)."""
    path, inventory = _load(fixture_dir)
    patterns = ["all", *_patterns(fixture_dir)]
    outputs = _parallel([("ansible", pattern, "--list-hosts") for pattern in patterns], ansible_env, path)
    for pattern, output in zip(patterns, outputs, strict=True):
        expected = _list_hosts(output)
        if not expected:
            assert pattern == "all" and not inventory.hosts, f"{pattern!r} matches nothing in Ansible"
            continue
        selected = [h.name for h in inventory.select(pattern)]
        assert _comparable(fixture_dir, selected) == _comparable(fixture_dir, expected), pattern


def test_host_order_equals_ansible(fixture_dir: Path, ansible_env: tuple[dict[str, str], Path]) -> None:
    path, inventory = _load(fixture_dir)
    expected = _list_hosts(_run(ansible_env, "ansible", path, "all", "--list-hosts"))
    assert _comparable(fixture_dir, list(inventory.hosts)) == _comparable(fixture_dir, expected)


def test_unmatched_pattern_is_empty_in_ansible_and_an_error_here(
    ansible_env: tuple[dict[str, str], Path],
) -> None:
    path, inventory = _load(FIXTURES[0])
    for pattern in ("no-such-host", "a:&no-such-group", "*:!*"):
        assert _list_hosts(_run(ansible_env, "ansible", path, pattern, "--list-hosts")) == []
        with pytest.raises(InventoryError, match="matches no hosts"):
            inventory.select(pattern)
