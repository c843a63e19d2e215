"""The README guides with real output: each block marked `<!-- sample: ARGS -->` is what `ernie-deploy ARGS`
prints today (issue 38), so the guide cannot drift from the tool; and every document is in docs/README.md's
index."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ernie_deploy.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = re.compile(r"<!-- sample: (.+?) -->\n```text\n(.*?)\n```", re.S)


def test_the_readme_guides_in_about_200_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize(("argv", "shown"), SAMPLES.findall((ROOT / "README.md").read_text()))
def test_each_sample_is_what_the_command_prints(argv: str, shown: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    main(shlex.split(argv))
    assert capsys.readouterr().out.rstrip("\n") == shown


def test_every_document_is_indexed() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md"
               and f"({p.name}" not in index]
    assert missing == []
