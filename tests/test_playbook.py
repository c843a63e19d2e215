from pathlib import Path

import pytest

from ernie_deploy.checks.playbook import load_playbook
from ernie_deploy.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_example_playbook_loads() -> None:
    exp = load_playbook(ROOT / "playbooks/verify.yml")
    assert exp.stream is True
    assert "Using max model len {max_model_len}" in exp.expect
    assert exp.forbid


@pytest.mark.parametrize(("text", "message"), [
    ("verfiy: {}\n", "verfiy: unknown key"),
    ("verify: {expect: [1]}\n", r"verify\.expect\[0\]: expected str"),
    ("verify: {expect: 'x'}\n", r"verify\.expect: expected list"),
    ("verify: {stream: 'yes'}\n", r"verify\.stream: expected bool"),
    ("verify: {forbidden: []}\n", r"verify\.forbidden: unknown key"),
    ("verify: [\n", "malformed YAML"),
])
def test_bad_playbooks_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_playbook(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("text", "message"), [
    ("verify: {expect: ['Using max model len {max_model_lenn}']}\n",
     r"verify\.expect\[0\]: .*unknown placeholder \{max_model_lenn\}"),
    ("verify: {forbid: ['ok', 'bad (regex']}\n", r"verify\.forbid\[1\]: .*not a valid regular expression"),
])
def test_pattern_typos_fail_when_the_playbook_loads(tmp_path: Path, text: str, message: str) -> None:
    """Found at load time (exit 5 before any host is touched), not after hosts were restarted."""
    path = tmp_path / "p.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_playbook(path)


def test_deploy_with_a_bad_playbook_touches_no_host(tmp_path: Path) -> None:
    from ernie_deploy.cli.main import main

    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    h:\n      ansible_host: 127.0.0.1\n      ansible_port: 1\n"
                   "      gpu_model: NVIDIA A10\n      gpu_count: 1\n")
    book = tmp_path / "p.yml"
    book.write_text("verify: {expect: ['{nope}']}\n")
    # The playbook error comes first, with the input exit code; the host (a closed port) is never tried.
    assert main(["deploy", "-i", str(inv), "--playbook", str(book), "--connect-timeout", "0.1"]) == 5
