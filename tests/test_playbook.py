from pathlib import Path

import pytest

from ernie_deploy.errors import ConfigError
from ernie_deploy.playbook import load_playbook

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
