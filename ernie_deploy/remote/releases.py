"""Releases kept on a host (written by converge's stage): list them, restore one (whole or per instance).

A restore puts the release's files back atomically and marks their units pending; activating those units
(restart) is the caller's next step, as after any stage. Restoring a release restores its env files too,
secrets included: a rotated key comes back with an old release.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from ernie_deploy.planning.render import ENV_DIR, UNIT_DIR
from ernie_deploy.remote.command import Command, Op
from ernie_deploy.remote.state import PENDING_FILE, RELEASES_DIR

MARK = "@@ernie-deploy:release-json "


@dataclass(frozen=True)
class Release:
    id: str
    time: str
    user: str
    command: str
    files: dict[str, str]  # path → sha256
    changed: tuple[str, ...]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Release:
        return cls(str(data["id"]), str(data.get("time", "")), str(data.get("user", "")),
                   str(data.get("command", "")), {str(k): str(v) for k, v in dict(data.get("files", {})).items()},
                   tuple(str(p) for p in data.get("changed", ())))


def list_command() -> Command:
    return Command(Op.RELEASES, f"for d in $(ls -1 {RELEASES_DIR} 2>/dev/null | grep -v '\\.tmp$' | sort); do "
                                f"printf '{MARK}'; tr -d '\\n' < {RELEASES_DIR}/\"$d\"/release.json; echo; done\n")


def parse_list(text: str) -> list[Release]:
    """Oldest first; a release whose record is unreadable is skipped (it cannot be restored safely)."""
    out = []
    for line in text.splitlines():
        if line.startswith(MARK):
            try:
                out.append(Release.from_json(json.loads(line[len(MARK):])))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def restore_command(release: Release, units: tuple[str, ...] = ()) -> Command:
    """Put back a release's files (only those of `units`, or all) and mark their units pending."""
    q = shlex.quote

    def wanted(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return not units or any(name in (u, u.removesuffix(".service") + ".env") for u in units)

    paths = sorted(p for p in release.files if wanted(p) and p.startswith((UNIT_DIR + "/", ENV_DIR + "/")))
    src = f"{RELEASES_DIR}/{release.id}"
    lines = ["set -eu", "umask 077"]
    for path in paths:
        parent, name = path.rsplit("/", 1)
        tmp = f"{parent}/.{name}.new"
        lines += [f"cp -p {q(src + path)} {q(tmp)}", f"mv -f {q(tmp)} {q(path)}"]
    restored = sorted({p.rsplit("/", 1)[1].removesuffix(".env").removesuffix(".service") + ".service" for p in paths})
    if restored:
        lines += [f"printf '%s\\n' {' '.join(q(u) for u in restored)} >> {PENDING_FILE}",
                  f"sort -u -o {PENDING_FILE} {PENDING_FILE}"]
    return Command(Op.RESTORE, "\n".join(lines) + "\n", units=tuple(restored))
