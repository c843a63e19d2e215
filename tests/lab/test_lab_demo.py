"""The README's main job, run as a test: scripts/demo boots its own lab of bare hosts, runs site.yml, status
and rolling-restart.yml under a bounded load, and `scripts/demo down` removes the lab."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ernie_deploy.lab import Lab

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("demo-a10-1", "demo-a10-2", "demo-a100-2")


@pytest.fixture(scope="module")
def demo_dir(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Needs the session lab only to know the machine can run one (and to have built its root file system)."""
    path = tmp_path_factory.mktemp("demo") / "lab"
    yield path
    subprocess.run([str(ROOT / "scripts/demo"), "down"], env={**os.environ, "ERNIE_DEMO_DIR": str(path)},
                   capture_output=True, timeout=300)


def test_demo_runs_the_whole_job_on_the_lab(demo_dir: Path) -> None:
    env = {**os.environ, "ERNIE_DEMO_DIR": str(demo_dir)}
    # One stream, in the order a reader sees it: the demo's headings and the tools' results interleave.
    done = subprocess.run([str(ROOT / "scripts/demo")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, out[-4000:]
    site, _, restart = out.partition("rolling-restart.yml under")
    for host in HOSTS:
        # site.yml's verify task passed on every instance...
        assert re.search(rf"ok: {host} \([\d.]+s\) all \d+ checks passed", site), host
        # ...and the rolling restart restarted each one, verified, with the recap to show it.
        assert re.search(rf"changed: {host} \([\d.]+s\) restarted ernie-vllm-0.service; every instance verified",
                         restart), host
        assert re.search(rf"{host}\s+: ok=2\s+changed=1\s+unreachable=0\s+failed=0", restart), host
    assert "no drift" in site
    assert re.search(r"load: \d+ requests, \d+ retried on another instance, 0 lost", restart)
    assert "scripts/demo down" in out
    down = subprocess.run([str(ROOT / "scripts/demo"), "down"], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and not (demo_dir / "state.json").exists(), down.stderr
