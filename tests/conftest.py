"""Shared fixtures for the planning-core tests: inventories written to tmp_path, planned in memory."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def write_inventory(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str, name: str = "inventory.yml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def plan_one(write_inventory: Callable[[str], Path]) -> Callable[..., HostPlan]:
    """Plan a single host `h` with the given variables."""

    def plan(**host_vars: object) -> HostPlan:
        import yaml

        path = write_inventory(yaml.safe_dump({"all": {"hosts": {"h": host_vars}}}))
        inventory = load_inventory(path)
        (result,) = plan_hosts(list(inventory.select(None)), PlanContext.load(base_dir=path.parent))
        return result

    return plan


def codes(plan: HostPlan) -> dict[str, str]:
    """Finding code → severity, for compact assertions."""
    return {f.code: f.severity.value for f in plan.findings}
