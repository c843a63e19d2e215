import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_strict_is_clean() -> None:
    # The same interpreter as the tests, so the venv's mypy and stubs; [tool.mypy] in pyproject.toml sets
    # strict mode and the files (the whole ernie_deploy package).
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
