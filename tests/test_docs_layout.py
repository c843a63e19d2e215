"""docs/layout.md's "Where a change goes" names files and examples to copy: each must still exist, or the
newcomer it is written for copies something that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ernie_deploy"


def table() -> list[list[str]]:
    text = (ROOT / "docs/layout.md").read_text().split("## Where a change goes", 1)[1]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return rows[1:]  # the header row


def test_every_path_in_the_where_a_change_goes_table_exists() -> None:
    rows = table()
    assert len(rows) >= 8
    for row in rows:
        for path in re.findall(r"`([\w/.]+(?:\.py|/))`", "|".join(row)):
            candidates = [ROOT / path, PACKAGE / path]
            assert any(c.exists() for c in candidates), (row[0], path)


def test_every_example_to_copy_is_still_defined() -> None:
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    for row in table():
        copy = row[2]
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", copy):
            if name.endswith(".py"):
                continue
            last = name.rsplit(".", 1)[-1]
            assert re.search(rf"\b(def|class) {re.escape(last)}\b|\b{re.escape(last)}\b *[:=]", source), (row[0], name)
