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


def test_the_install_line_gives_a_working_command_in_a_clean_venv(tmp_path: Path) -> None:
    """What `pipx install .` and `uv tool install .` do (README, Install): the wheel and its dependencies in a venv
    of their own, nothing from the test environment; the command plans the example and names its commit."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "w"),
                            str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "w").glob("ernie_deploy-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], capture_output=True,
                               text=True, timeout=900)
    assert installed.returncode == 0, installed.stderr
    tool = venv / "bin" / "ernie-deploy"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    version = subprocess.run([str(tool), "--version"], capture_output=True, text=True, env=env, timeout=60)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, timeout=60).stdout.strip()
    assert version.returncode == 0 and version.stdout.startswith("ernie-deploy "), version.stderr
    if head:  # a checkout with git: the build names its commit
        assert f"(commit {head}" in version.stdout, version.stdout
    plan = subprocess.run([str(tool), "plan", "-i", str(ROOT / "inventory" / "example.yml")], capture_output=True,
                          text=True, env=env, timeout=120, cwd=tmp_path)
    assert plan.returncode == 1 and "gpu-a10-05.dc1" in plan.stdout and "tp-heads" in plan.stdout, plan.stderr
