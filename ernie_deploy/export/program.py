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

# Text that only an export with balancers ships lies between these lines (each on a line of its own, indented as
# the code around it); an export without balancers drops it whole, so it stays byte for byte what it was before
# balancers existed.
_REGION = re.compile(r"^[ \t]*# >>> balancers\n.*?^[ \t]*# <<< balancers\n", re.M | re.S)
_REGION_LINE = re.compile(r"^[ \t]*# (?:>>>|<<<) balancers\n", re.M)
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


def regions(text: str, balancers: bool) -> str:
    """Shared content with its balancer regions: kept (their marker lines dropped) or dropped whole."""
    return _REGION_LINE.sub("", text) if balancers else _REGION.sub("", text)


def host_program(signatures: tuple[Signature, ...] | None = None, balancers: bool = True) -> str:
    """hostscript.py as it ships in the role: DATA holds the patterns (plain JSON, read with json.loads), the
    host paths are ernie-deploy's own (planning/hostpaths.py), and the `haproxy` command is there only for an
    export with balancers."""
    source = regions((resources.files("ernie_deploy.export") / "hostscript.py").read_text(encoding="utf-8"),
                     balancers)
    if source.count(_DATA_LINE) != 1:
        raise AssertionError("hostscript.py lost its DATA line")
    for name in hostpaths.EXPORTED:
        source, found = re.subn(rf"^{name} = .*$", f"{name} = {getattr(hostpaths, name)!r}", source, flags=re.M)
        if found != 1:
            raise AssertionError(f"hostscript.py lost its {name} line")
    data = json.dumps(checker_data(signatures), sort_keys=True)
    return source.replace(_DATA_LINE, f"DATA: dict[str, Any] = json.loads({data!r})\n")
