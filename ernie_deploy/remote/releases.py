"""Releases kept on a host (written by converge's stage): list them, restore one (whole or per instance).

A restore puts the release's files back atomically and marks their units pending; activating those units
(restart) is the caller's next step, as after any stage. Restoring a release restores its env files too,
secrets included: a rotated key comes back with an old release.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ernie_deploy.planning.render import ENV_DIR, UNIT_DIR
from ernie_deploy.remote.command import Command, Op
from ernie_deploy.remote.rolling import audit_line
from ernie_deploy.remote.state import RELEASES_DIR, pending_add, pending_remove

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


def restore_command(release: Release, units: tuple[str, ...] = (), audit: dict[str, Any] | None = None) -> Command:
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
        lines += pending_add(dict.fromkeys(restored))
    if audit is not None:
        lines.append(audit_line(audit))
    return Command(Op.RESTORE, "\n".join(lines) + "\n", units=tuple(restored))


def current(releases: Sequence[Release], files: Mapping[str, str]) -> Release | None:
    """The newest release whose managed files are exactly the host's (path and hash): what runs, or would
    run after a restart. None on a first deploy, or when the files were changed by hand since."""
    for release in reversed(releases):
        if release.files == dict(files):
            return release
    return None


def previous(releases: Sequence[Release], files: Mapping[str, str]) -> Release | None:
    """The release before the current one (newest older release with other files): what `rollback` restores."""
    now = current(releases, files)
    older = [r for r in releases if now is None or r.id < now.id]
    for release in reversed(older):
        if now is None or release.files != now.files:
            return release
    return None


def unit_path(unit: str) -> str:
    return f"{UNIT_DIR}/{unit}"


def env_path(unit: str) -> str:
    return f"{ENV_DIR}/{unit.removesuffix('.service')}.env"


def running_releases(releases: Sequence[Release], files: Mapping[str, str],
                     units: Sequence[str]) -> dict[str, Release]:
    """Per unit, the newest release whose unit and env file are the installed ones: what that unit runs (or runs
    after a restart). Per unit, because one-at-a-time changes and per-instance rollbacks leave a host whose
    units come from different releases. A unit no release has (new, or edited by hand) is absent."""
    out = {}
    for unit in units:
        paths = (unit_path(unit), env_path(unit))
        for release in reversed(releases):
            if unit_path(unit) in release.files and all(release.files.get(p) == files.get(p) for p in paths):
                out[unit] = release
                break
    return out


def has_unit(release: Release, unit: str) -> bool:
    return unit_path(unit) in release.files


def undo_command(restore: Mapping[str, Release], stop: tuple[str, ...], disable: tuple[str, ...],
                 audit: dict[str, Any]) -> Command:
    """Undo a failed change on a host, atomically per file: put each unit of `restore` back to its release's
    files (so what is on disk is again what ran) and take it off the pending list; stop `stop` units (the
    caller starts them again once their GPUs are free); stop and disable `disable` units (no earlier release
    has them: a first deploy)."""
    q = shlex.quote
    lines = ["set -eu", "umask 077"]
    for unit, release in sorted(restore.items()):
        lines += restore_command(release, (unit,)).script.splitlines()[2:]
    lines.append("systemctl daemon-reload")
    for unit in stop + disable:
        lines.append(f"systemctl stop {q(unit)} || true")
        lines.append(f"systemctl reset-failed {q(unit)} 2>/dev/null || true")
    if disable:
        lines.append("systemctl disable -q " + " ".join(q(u) for u in disable) + " || true")
    done = tuple(sorted(restore)) + disable
    if done:
        lines.append(pending_remove(done))
    lines.append(audit_line(audit))
    return Command(Op.UNDO, "\n".join(lines) + "\n", units=done, timeout=3600)


def unit_values(text: str) -> dict[str, str]:
    """What a rendered unit file says its instance serves: the `vllm serve` flags of ExecStart and
    CUDA_VISIBLE_DEVICES, to verify a restored release against itself rather than against today's plan."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("Environment=CUDA_VISIBLE_DEVICES="):
            values["gpus"] = line.split("=", 2)[2].strip()
        elif line.startswith("ExecStart="):
            words = shlex.split(line[len("ExecStart="):])
            for k, word in enumerate(words):
                if word.startswith("--") and k + 1 < len(words) and not words[k + 1].startswith("--"):
                    values.setdefault(word[2:], words[k + 1])
    return values
