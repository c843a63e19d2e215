"""Keep the layers honest: the planning core imports no SSH, terminal or process libraries."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ernie_deploy"
CORE = ["bulk", "datafiles", "errors", "findings", "hardware", "inventory", "inventory_groups", "inventory_patterns",
        "inventory_yaml", "memory", "models", "plan", "plantypes", "recommend", "render", "settings", "validate",
        "versions"]
FORBIDDEN = {"rich", "paramiko", "fabric", "subprocess", "socket", "ernie_deploy.console", "ernie_deploy.cli"}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", CORE)
def test_core_module_is_pure(module: str) -> None:
    found = {n for n in imports(PKG / f"{module}.py") if n in FORBIDDEN or n.split(".")[0] in FORBIDDEN}
    assert not found, f"{module}.py imports {found}"


def test_only_console_imports_rich() -> None:
    users = [p.name for p in PKG.rglob("*.py") if any(n.split(".")[0] == "rich" for n in imports(p))]
    assert users == ["console.py"]
