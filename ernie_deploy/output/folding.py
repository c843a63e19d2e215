"""Host names folded the way an inventory writes ranges: gpu-a10-01.dc1 … gpu-a10-40.dc1 → gpu-a10-[01:40].dc1, so a
fleet's output names 40 identical hosts in one line. Names alike in everything but one number (of the same
width) fold into runs of that number; where several numbers vary, the last one folds; anything else is listed
as it is."""

from __future__ import annotations

import re
from collections.abc import Sequence

_PARTS = re.compile(r"\d+|\D+")


def fold_names(names: Sequence[str]) -> str:
    """The names as one comma-separated text, consecutive numbered names as [first:last] ranges."""
    shapes: dict[tuple[str, ...], list[list[str]]] = {}
    for name in dict.fromkeys(names):
        parts = _PARTS.findall(name)
        shape = tuple(p if not p.isdigit() else f"#{len(p)}" for p in parts)
        shapes.setdefault(shape, []).append(parts)
    return ", ".join(text for members in shapes.values() for text in _fold(members))


def _fold(members: list[list[str]]) -> list[str]:
    """Names of one shape: folded along the last numeric part that varies, the others fixed per line."""
    varying = [i for i in range(len(members[0])) if len({m[i] for m in members}) > 1]
    if not varying or not members[0][varying[-1]].isdigit():
        return ["".join(m) for m in members]
    at = varying[-1]
    lines: dict[tuple[str, ...], list[int]] = {}
    for m in members:
        lines.setdefault((*m[:at], "*", *m[at + 1:]), []).append(int(m[at]))
    width = len(members[0][at])
    out = []
    for template, numbers in lines.items():
        for first, last in _runs(numbers):
            run = f"{first:0{width}d}" if first == last else f"[{first:0{width}d}:{last:0{width}d}]"
            out.append("".join(run if i == at else p for i, p in enumerate(template)))
    return out


def _runs(numbers: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs
