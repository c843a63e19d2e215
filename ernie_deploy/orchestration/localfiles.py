"""The controller's side of a directory copy: a manifest of a local directory (sha256 per file, cached by
size and mtime so a second run does not re-read 40 GB) and a chunked, rate-limited, stoppable reader."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ernie_deploy.errors import DeployError
from ernie_deploy.planning.provisioning import Entry, Manifest

CHUNK = 1024 * 1024
# Never part of a model: git's and the Hub client's own bookkeeping.
SKIPPED_DIRS = {".git", ".cache"}


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ernie-deploy" / "hashes.json"


class HashCache:
    """sha256 by (absolute path, size, mtime_ns); shared by the threads of one run, saved at the end."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_file()
        self.lock = threading.Lock()
        self.entries: dict[str, list[object]] = {}
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads(self.path.read_text())
            if isinstance(raw, dict):
                self.entries = raw
        self.dirty = False

    def sha256(self, path: Path) -> tuple[int, str]:
        st = path.stat()
        key = str(path.resolve())
        with self.lock:
            known = self.entries.get(key)
        if known is not None and known[:2] == [st.st_size, st.st_mtime_ns]:
            return st.st_size, str(known[2])
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                digest.update(block)
        with self.lock:
            self.entries[key] = [st.st_size, st.st_mtime_ns, digest.hexdigest()]
            self.dirty = True
        return st.st_size, digest.hexdigest()

    def save(self) -> None:
        if not self.dirty:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False) as fh:
                json.dump(self.entries, fh)
            os.replace(fh.name, self.path)
            self.dirty = False


def scan(root: Path, cache: HashCache) -> Manifest:
    """Every regular file under `root` (following no symlinked directories), by POSIX relative path."""
    if not root.is_dir():
        raise DeployError(f"vllm_model_source {root} is not a directory on this machine",
                          hint="point vllm_model_source at the model's directory (or hf://ORG/NAME@REVISION)")
    out: Manifest = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if "\n" in rel or "\t" in rel:
                raise DeployError(f"{path}: a file name with a tab or newline cannot be copied",
                                  hint="rename it")
            size, digest = cache.sha256(path)
            out[rel] = Entry(size, digest)
    if not out:
        raise DeployError(f"vllm_model_source {root} holds no files", hint="point it at the model's directory")
    return out


def chunks(path: Path, offset: int, *, rate: float | None, sent: Callable[[int], None],
           stop: Callable[[], bool]) -> Iterator[bytes]:
    """The file from `offset` in CHUNK pieces; `sent(n)` after each, at most `rate` bytes/s, ending early
    (so the host keeps what arrived) once `stop()` says so."""
    started = time.monotonic()
    done = 0
    with open(path, "rb") as fh:
        fh.seek(offset)
        while not stop():
            block = fh.read(CHUNK if rate is None else max(1, min(CHUNK, int(rate / 4))))
            if not block:
                return
            yield block
            done += len(block)
            sent(done)
            if rate is not None:
                ahead = done / rate - (time.monotonic() - started)
                while ahead > 0 and not stop():
                    time.sleep(min(ahead, 0.1))
                    ahead = done / rate - (time.monotonic() - started)
