"""What the lab's inventory points `provision` at, on this machine: a wheelhouse of simulator wheels and a
model directory (the bundled config plus deterministic stand-in weights), both copied over SSH."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

from ernie_deploy.lab import wheel
from ernie_deploy.lab.spec import LabSpec
from ernie_deploy.lab.tokenizer import write_tokenizer
from ernie_deploy.planning.drivers import releases

MODEL_NAME = "ERNIE-4.5-0.3B-PT"
# Big enough that a copy takes a measurable moment (and can be interrupted under --bwlimit), small enough
# for every lab boot.
WEIGHT_BYTES = 4 * 1024 * 1024


def wheelhouse(lab_dir: Path, spec: LabSpec) -> Path:
    """`<lab>/wheelhouse`: a simulator wheel for every release docs/drivers.md has a row for, and for every
    version the spec's hosts claim (the simulator behaves as its nearest lower profile)."""
    versions = set(releases()) | {h.installed_version for h in spec.hosts if not h.real}
    return wheel.build_wheelhouse(lab_dir / "wheelhouse", versions)


def model_source(lab_dir: Path) -> Path:
    """`<lab>/model-source/ERNIE-4.5-0.3B-PT`: config.json, a tokenizer sized to its vocabulary (real vLLM
    needs one; tokenizer.py) and a safetensors file of seeded random bytes (the same on every boot, so its
    manifest is too; real vLLM never reads it: lab hosts serve it with `--load-format dummy`)."""
    target = lab_dir / "model-source" / MODEL_NAME
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel.PACKAGE_DIR / "data" / "models" / MODEL_NAME / "config.json", target / "config.json")
    write_tokenizer(target)
    weights = target / "model.safetensors"
    if not weights.is_file():
        count = WEIGHT_BYTES // 2
        header = json.dumps({"__metadata__": {"format": "pt"},
                             "lm_head.weight": {"dtype": "BF16", "shape": [count],
                                                "data_offsets": [0, count * 2]}}).encode()
        header += b" " * (-len(header) % 8)
        tmp = weights.with_suffix(".tmp")
        tmp.write_bytes(struct.pack("<Q", len(header)) + header + random.Random(45).randbytes(count * 2))
        tmp.rename(weights)
    return target
