"""The audit log on a host: one JSON record per line, appended by the command that made the change, in the
same round trip, so a change and its record cannot part."""

from __future__ import annotations

import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from ernie_deploy.planning.hostpaths import AUDIT_LOG

AUDIT_DIR = str(PurePosixPath(AUDIT_LOG).parent)


def encode(record: dict[str, Any]) -> str:
    """A record as its line in the log."""
    return json.dumps(record, sort_keys=True) + "\n"


def audit_line(record: dict[str, Any]) -> str:
    """The shell line appending `record` to the host's audit log (root-only: records name users and files)."""
    q = shlex.quote
    return (f"mkdir -p $(dirname {AUDIT_LOG}); printf '%s\\n' {q(json.dumps(record, sort_keys=True))} >> {AUDIT_LOG}; "
            f"chmod 0600 {AUDIT_LOG}")


def append_from(path: str) -> str:
    """The shell line appending the records already in file `path` (a stage's payload) to the audit log."""
    return f"cat {path} >> {AUDIT_LOG}; chmod 0600 {AUDIT_LOG}"
