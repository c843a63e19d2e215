"""A normal (non-editable) install must carry the templates and data files."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_templates_and_data(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("ernie_deploy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("ernie_deploy/templates/vllm.service.j2", "ernie_deploy/templates/vllm.env.j2",
                   "ernie_deploy/templates/haproxy.cfg.j2",
                   "ernie_deploy/data/recommendations.yml", "ernie_deploy/data/gpus.yml",
                   "ernie_deploy/data/signatures.yml", "ernie_deploy/data/vllm_versions.yml",
                   "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json", "ernie_deploy/lab/sim/__init__.py",
                   "ernie_deploy/lab/sim/vllm_sim.py", "ernie_deploy/cli/main.py",
                   # Sent to hosts as text, read with importlib.resources.
                   "ernie_deploy/remote/programs/http_probe.py", "ernie_deploy/export/hostscript.py"):
        assert needed in names, needed
