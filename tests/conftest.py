"""Shared fixtures for the planning-core tests (inventories written to tmp_path, planned in memory), the
`needs_program` markers of the tests that run a Debian program (HAProxy, promtool, systemd-analyze), and the
`lab` marker on every test that uses the simulated lab."""

from __future__ import annotations

import os
import shutil
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# A suite started from a script's background job or under nohup inherits SIGINT ignored, and so would every program
# a test starts (exec keeps an ignored signal ignored): a test that stops one with SIGINT, as Ctrl-C does, would wait
# for it in vain. With a handler here, each child starts with SIGINT at its default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def needs_program(program: str, package: str) -> pytest.MarkDecorator:
    """Skip only on a developer machine without `program`; under .ci/run (ERNIE_LAB_REQUIRED=1) or any CI the test
    runs and a missing program fails it, because scripts/test installs the Debian `package` there."""
    return pytest.mark.skipif(
        shutil.which(program) is None and not os.environ.get("CI") and os.environ.get("ERNIE_LAB_REQUIRED") != "1",
        reason=f"{program} is not installed (apt-get install {package}); scripts/test installs it",
    )


needs_haproxy = needs_program("haproxy", "haproxy")

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
