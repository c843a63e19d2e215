"""Writing a directory whole on the controller: into a fresh directory beside the target, then swapped in, so
a reader never sees it half written (render's per-host trees, export's project)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path


def swap_in(target: Path, files: Iterable[tuple[str, str, int]]) -> None:
    """Make `target` hold exactly `files` (relative path, content, mode), replacing what was there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for rel, content, mode in files:
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(content)
        os.chmod(staging, 0o755)
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
