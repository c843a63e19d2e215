"""Keep the layers honest: walk the package's folders and check every module's imports against its floor.

A module's layer is its folder (`ernie_deploy/<layer>/...`); the top level holds only the entry points and
the error family. The rules (see README, "Layout"):
  * inventory, planning, checks: pure; they import each other and `errors` only;
  * remote adds planning; orchestration adds remote and checks; lab adds remote and planning;
  * cli and output may import anything of ernie_deploy;
  * lab/sim (the simulated vLLM and nvidia-smi) imports only itself and the standard library, and nothing
    outside lab imports it, so planner and simulator stay independent.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ernie_deploy"
PURE = {"inventory", "planning", "checks", "playbook", "errors"}
ALLOWED: dict[str, set[str]] = {
    "top": PURE | {"cli", "output", "orchestration", "remote", "lab"},  # __main__ runs the CLI
    "inventory": PURE,
    "planning": PURE,
    "checks": PURE,
    "playbook": PURE,
    "remote": PURE | {"remote"},
    "orchestration": PURE | {"remote", "orchestration"},
    "lab": PURE | {"remote", "lab"},
    # The Ansible export: plan in, files out. Its host program (export/hostscript.py) imports only the standard
    # library, since it runs on the hosts.
    "export": PURE | {"export"},
    "cli": PURE | {"remote", "orchestration", "lab", "cli", "output", "export"},
    "output": PURE | {"remote", "orchestration", "output"},
}
# Libraries that do I/O or draw on a terminal: never in the pure layers.
IMPURE_LIBS = {"rich", "paramiko", "fabric", "invoke", "subprocess", "socket", "urllib", "http"}
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py"}
# Written by a build (hatch-vcs: the version and its commit), absent from a fresh checkout; imports nothing.
BUILT = {"_version.py"}


def modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def layer_of(path: Path) -> str:
    parts = path.relative_to(PKG).parts
    if len(parts) == 1:
        return "top"
    if parts[:2] == ("lab", "sim"):
        return "sim"
    return parts[0]


def imports(path: Path) -> set[str]:
    """Absolute module names imported by a file (relative imports resolved against its package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = ".".join(("ernie_deploy", *path.relative_to(PKG).parent.parts))
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.add(node.module)
                if node.module == "ernie_deploy":  # `from ernie_deploy import x`: x is a submodule or a name
                    names |= {f"ernie_deploy.{a.name}" for a in node.names}
    return names


def ernie_layer(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "ernie_deploy":
        return None
    if len(parts) == 1 or parts[1] in ("__version__", "_version"):
        return "top"
    if parts[1:3] == ["lab", "sim"]:
        return "sim"
    return parts[1].removesuffix(".py")


def test_the_walk_sees_every_layer() -> None:
    seen = {layer_of(p) for p in modules()}
    assert seen == set(ALLOWED) | {"sim"}, f"new folder? give it a rule in ALLOWED: {seen ^ (set(ALLOWED) | {'sim'})}"
    assert {p.name for p in modules() if layer_of(p) == "top"} - BUILT == TOP_LEVEL


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_module_imports_only_its_floor_and_below(path: Path) -> None:
    layer = layer_of(path)
    found = imports(path)
    if layer == "sim":
        outside = {n for n in found if n.split(".")[0] == "ernie_deploy" and ernie_layer(n) != "sim"}
        assert not outside, f"the simulator must not import the rest of ernie_deploy: {outside}"
        third_party = {n for n in found if n.split(".")[0] not in sys.stdlib_module_names
                       and n.split(".")[0] != "ernie_deploy"}
        assert not third_party, f"the simulator runs on a bare lab host: stdlib only, found {third_party}"
        return
    bad = {n for n in found if ernie_layer(n) not in (None, "top") and ernie_layer(n) not in ALLOWED[layer]}
    assert not bad, f"{layer}/ may import {sorted(ALLOWED[layer])} of ernie_deploy, found {sorted(bad)}"
    if layer in PURE:
        impure = {n for n in found if n.split(".")[0] in IMPURE_LIBS}
        assert not impure, f"{layer}/ is pure: no I/O or terminal libraries, found {impure}"


def test_nothing_outside_lab_imports_the_simulator() -> None:
    users = [str(p.relative_to(PKG)) for p in modules()
             if layer_of(p) not in ("lab", "sim") and any(ernie_layer(n) == "sim" for n in imports(p))]
    assert users == []


def test_only_the_console_imports_rich() -> None:
    users = [str(p.relative_to(PKG)) for p in modules() if any(n.split(".")[0] == "rich" for n in imports(p))]
    assert sorted(users) == ["output/console.py", "output/terminal.py"]


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    """The walk is only worth something if a bad import fails it."""
    bad = tmp_path / "x.py"
    bad.write_text("from ernie_deploy.remote.ssh import connect\nimport paramiko\n")
    found = imports(bad)
    assert {ernie_layer(n) for n in found} - {None} == {"remote"}
    assert "remote" not in ALLOWED["planning"] and "paramiko" in IMPURE_LIBS
