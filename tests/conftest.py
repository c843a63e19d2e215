"""Shared fixtures for the planning-core tests (inventories written to tmp_path, planned in memory), the
`needs_haproxy` marker of the tests that run Debian's HAProxy, and the `lab` marker on every test that uses the
simulated lab."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Skips only on a developer machine without HAProxy; under .ci/run (ERNIE_LAB_REQUIRED=1) or any CI the tests
# run and a missing haproxy fails them, because scripts/test installs Debian's haproxy there.
needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None and not os.environ.get("CI") and os.environ.get("ERNIE_LAB_REQUIRED") != "1",
    reason="haproxy is not installed (apt-get install haproxy); scripts/test installs it",
)

# The fixtures of tests/lab/conftest.py that boot (or clean up after) the simulated lab; unit tests elsewhere
# have fixtures of their own named `lab` (a simulator in a temporary directory).
LAB_TESTS = Path(__file__).resolve().parent / "lab"
SIM_LAB_FIXTURES = frozenset({"lab", "lab_state", "units"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the simulated lab is a lab test even where its module forgot `pytestmark`: scripts/test
    runs `-m "lab and not real_vllm"` and `-m "real_vllm or not lab"` side by side, and an unmarked one would boot
    a second simulated lab on the same addresses from the other process."""
    for item in items:
        uses_lab = SIM_LAB_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses_lab and item.path.is_relative_to(LAB_TESTS) and item.get_closest_marker("lab") is None:
            item.add_marker(pytest.mark.lab)


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
