"""Which files of an export directory ernie-deploy wrote: the manifest (`.ernie-export`), one list per exporter.

A re-export replaces and removes only files its own exporter listed there last time; everything else in the
directory (`.git/`, the user's vault.yml, another exporter's files) is left alone. A directory that holds files
and no manifest is not an export: nothing is written into it. Pure: text in, decisions out; cli/export.py writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MANIFEST = ".ernie-export"
_ABOUT = ("written by ernie-deploy export: the files each exporter wrote; a re-export replaces and removes only "
          "those, and leaves every other file here alone")


@dataclass(frozen=True)
class Manifest:
    owned: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # exporter → relative paths it wrote
    # An export made before manifests (a one-line marker): its files are not known, so none is removed.
    legacy: bool = False

    def to_text(self) -> str:
        doc: dict[str, Any] = {"about": _ABOUT, "files": {k: list(v) for k, v in sorted(self.owned.items())}}
        return json.dumps(doc, indent=2) + "\n"

    def stale(self, kind: str, written: Sequence[str]) -> list[str]:
        """The files `kind` wrote last time and does not write now: to remove."""
        keep = set(written)
        return [p for p in self.owned.get(kind, ()) if p not in keep]

    def with_files(self, kind: str, written: Sequence[str]) -> Manifest:
        return Manifest({**self.owned, kind: tuple(sorted(written))})


def parse(text: str) -> Manifest | None:
    """The manifest a directory holds, or None when the text is none (a file of that name the user wrote)."""
    if text.startswith("written by ernie-deploy export"):
        return Manifest(legacy=True)
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, list) for v in files.values()):
        return None
    return Manifest({str(k): tuple(str(p) for p in v if _inside(str(p))) for k, v in files.items()})


def _inside(path: str) -> bool:
    """A path the manifest may name: relative, inside the directory (an edited manifest cannot reach out)."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and parts != [MANIFEST]
