"""The rehearsal lab, booted once per test session and always torn down.

Lab tests skip only on machines that cannot run containers at all (not root, systemd-nspawn or
debootstrap missing), and say so loudly. Set ERNIE_LAB_REQUIRED=1 (CI does) to turn that skip into a
failure, so a CI machine that lost its ability to run the lab can never pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ernie_deploy.lab import Lab, LabState, load_spec
from lab.labhelpers import Units, drop_balancers


def lab_unavailable() -> str | None:
    """Why this machine cannot run lab containers, or None if it can."""
    if os.geteuid() != 0:
        return "the lab needs root (it mounts overlays and boots systemd-nspawn containers)"
    for tool in ("systemd-nspawn", "debootstrap", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container debootstrap openssh-client)"
    return None


def require_lab() -> None:
    """Skip, loudly, on a machine that cannot run the lab; fail instead under ERNIE_LAB_REQUIRED=1 (CI)."""
    reason = lab_unavailable()
    if reason is not None:
        message = f"LAB TESTS NOT RUN: {reason}"
        sys.stderr.write(f"\n{'!' * 78}\n{message}\n{'!' * 78}\n")
        if os.environ.get("ERNIE_LAB_REQUIRED") == "1":
            pytest.fail(f"{message} (ERNIE_LAB_REQUIRED=1)", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    the_lab = Lab(tmp_path_factory.mktemp("lab"), progress=lambda m: sys.stderr.write(f"[lab] {m}\n"))
    try:
        # The lab tests written before the balancer keep an inventory without it (labhelpers.drop_balancers).
        drop_balancers(Path(the_lab.up(load_spec()).inventory))
        yield the_lab
    finally:
        the_lab.down()


@pytest.fixture(scope="session")
def lab_state(lab: Lab) -> LabState:
    return lab.require_state()


@pytest.fixture
def units(lab: Lab) -> Iterator[Units]:
    made = Units(lab)
    try:
        yield made
    finally:
        made.cleanup()
