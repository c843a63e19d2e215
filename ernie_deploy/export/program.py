"""The host program of the exported role (hostscript.py), with the project's own log patterns and host paths
filled in."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

from ernie_deploy.checks import logscan
from ernie_deploy.checks.signatures import MAX_SPAN, Signature, load_signatures
from ernie_deploy.planning import hostpaths

_DATA_LINE = "DATA: dict[str, Any] = {}  # replaced by `ernie-deploy export ansible` with the checks' patterns\n"


def checker_data(signatures: tuple[Signature, ...] | None = None) -> dict[str, Any]:
    sigs = signatures if signatures is not None else load_signatures()
    return {
        "patterns": logscan.patterns(),
        "max_span": MAX_SPAN,
        "signatures": [{"name": s.name, "regex": [rx.pattern for rx in s.regexes],
                        "end": s.end.pattern if s.end is not None else None, "severity": s.severity,
                        "generic": s.generic, "shutdown": s.shutdown, "cause": s.cause} for s in sigs],
    }


def host_program(signatures: tuple[Signature, ...] | None = None) -> str:
    """hostscript.py as it ships in the role: DATA holds the patterns (plain JSON, read with json.loads), and the
    host paths are ernie-deploy's own (planning/hostpaths.py)."""
    source = (resources.files("ernie_deploy.export") / "hostscript.py").read_text(encoding="utf-8")
    if source.count(_DATA_LINE) != 1:
        raise AssertionError("hostscript.py lost its DATA line")
    for name in hostpaths.EXPORTED:
        source, found = re.subn(rf"^{name} = .*$", f"{name} = {getattr(hostpaths, name)!r}", source, flags=re.M)
        if found != 1:
            raise AssertionError(f"hostscript.py lost its {name} line")
    data = json.dumps(checker_data(signatures), sort_keys=True)
    return source.replace(_DATA_LINE, f"DATA: dict[str, Any] = json.loads({data!r})\n")
