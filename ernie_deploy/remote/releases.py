"""Releases kept on a host (written by converge's stage): list them, restore one (whole or per instance).

A restore puts the release's files back atomically and marks their units pending; activating those units
(restart) is the caller's next step, as after any stage. Restoring a release restores its env files too,
secrets included: a rotated key comes back with an old release.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ernie_deploy.planning.hostpaths import ENV_DIR, RELEASES_DIR, UNIT_DIR
from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.protocol import marker
from ernie_deploy.remote.state import pending_add, pending_remove

MARK = marker("release-json")  # one kept release's record, on one line
DIR_MARK = marker("release-dir")  # the directory the next record comes from
FAILED_MARK = marker("release-failed")  # the failure record of the release before it, on one line
FAILED_FILE = "failed.json"  # in a release's directory: written when a start on it failed and was rolled back


@dataclass(frozen=True)
class Failed:
    """Why a release was rolled back on this host: its instance(s) failed to start on it."""

    time: str  # UTC, ISO 8601
    reason: str
    units: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "reason": self.reason, "units": list(self.units)}

    def describe(self) -> str:
        return f"failed at {self.time} on {', '.join(self.units) or 'this host'} and was rolled back: {self.reason}"


def failure(units: Sequence[str], reason: str) -> Failed:
    """A failure record stamped now."""
    return Failed(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), reason, tuple(units))


@dataclass(frozen=True)
class Release:
    id: str
    time: str
    user: str
    command: str
    files: dict[str, str]  # path → sha256
    changed: tuple[str, ...]
    failed: Failed | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Release:
        return cls(str(data["id"]), str(data.get("time", "")), str(data.get("user", "")),
                   str(data.get("command", "")), {str(k): str(v) for k, v in dict(data.get("files", {})).items()},
                   tuple(str(p) for p in data.get("changed", ())))


@dataclass(frozen=True)
class ListReleases(Intent):
    """Print every kept release's record, oldest first."""

    op: ClassVar[Op] = Op.RELEASES

    def render(self) -> str:
        return (f"for d in $(ls -1 {RELEASES_DIR} 2>/dev/null | grep -v '\\.tmp$' | sort); do "
                f"printf '{DIR_MARK}%s\\n' \"$d\"; printf '{MARK}'; tr -d '\\n' < {RELEASES_DIR}/\"$d\"/release.json; "
                f"echo; if [ -f {RELEASES_DIR}/\"$d\"/{FAILED_FILE} ]; then printf '{FAILED_MARK}'; "
                f"tr -d '\\n' < {RELEASES_DIR}/\"$d\"/{FAILED_FILE}; echo; fi; done\n")


def list_command() -> Command:
    return Command(ListReleases())


class Kept(list[Release]):
    """The kept releases, oldest first, and the directories whose record could not be read: those are left out
    (they cannot be restored safely), and said so."""

    def __init__(self, releases: Sequence[Release] = (), skipped: Sequence[str] = ()) -> None:
        super().__init__(releases)
        self.skipped = tuple(skipped)

    def notes(self) -> list[str]:
        return [f"release {name}: unreadable record in {RELEASES_DIR}, left out (no rollback goes to it)"
                for name in self.skipped]


def parse_list(text: str) -> Kept:
    out, skipped = [], []
    name = None
    read = False  # the last record was read: a failure record that follows is its
    for line in text.splitlines():
        if line.startswith(DIR_MARK):
            name, read = line[len(DIR_MARK):].strip(), False
        elif line.startswith(MARK):
            try:
                out.append(Release.from_json(json.loads(line[len(MARK):])))
                read = True
            except (ValueError, KeyError, TypeError):
                skipped.append(name or "(unnamed)")
            name = None
        elif line.startswith(FAILED_MARK) and read:
            out[-1] = dataclasses.replace(out[-1], failed=parse_failed(line[len(FAILED_MARK):]))
    return Kept(out, skipped)


def parse_failed(text: str) -> Failed:
    """A failure record; one that cannot be read still marks its release as failed (the reason says so)."""
    try:
        data = json.loads(text)
        return Failed(str(data["time"]), str(data["reason"]), tuple(str(u) for u in data.get("units", ())))
    except (ValueError, KeyError, TypeError, AttributeError):
        return Failed("?", "its failure record is unreadable")


@dataclass(frozen=True)
class Restore(Intent):
    """Put back the files at `paths` as release `release` has them, atomically per file, and mark their units
    pending."""

    op: ClassVar[Op] = Op.RESTORE
    release: str
    paths: tuple[str, ...]
    audit: dict[str, Any] | None = None

    @property
    def units(self) -> tuple[str, ...]:
        """The units whose unit or env file comes back."""
        return tuple(sorted({p.rsplit("/", 1)[1].removesuffix(".env").removesuffix(".service") + ".service"
                             for p in self.paths}))

    def moves(self) -> list[str]:
        """The shell lines that put the files back and mark the units pending."""
        q = shlex.quote
        src = f"{RELEASES_DIR}/{self.release}"
        lines = []
        for path in self.paths:
            parent, name = path.rsplit("/", 1)
            tmp = f"{parent}/.{name}.new"
            lines += [f"cp -p {q(src + path)} {q(tmp)}", f"mv -f {q(tmp)} {q(path)}"]
        if self.units:
            lines += pending_add(dict.fromkeys(self.units))
        return lines

    def render(self) -> str:
        lines = ["set -eu", "umask 077", *self.moves()]
        if self.audit is not None:
            lines.append(audit_line(self.audit))
        return "\n".join(lines) + "\n"


def restoring(release: Release, units: tuple[str, ...] = (), audit: dict[str, Any] | None = None) -> Restore:
    """What restoring a release's files (only those of `units`, or all) puts back."""

    def wanted(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return not units or any(name in (u, u.removesuffix(".service") + ".env") for u in units)

    paths = sorted(p for p in release.files if wanted(p) and p.startswith((UNIT_DIR + "/", ENV_DIR + "/")))
    return Restore(release.id, tuple(paths), audit)


def restore_command(release: Release, units: tuple[str, ...] = (), audit: dict[str, Any] | None = None) -> Command:
    """Put back a release's files (only those of `units`, or all) and mark their units pending."""
    return Command(restoring(release, units, audit))


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


@dataclass(frozen=True)
class Undo(Intent):
    """Undo a failed change on a host: put each unit of `back` back to its release's files (so what is on disk
    is again what ran) and take it off the pending list; stop the `stop` units (the caller starts them again
    once their GPUs are free); stop and disable the `disable` units (no earlier release has them)."""

    op: ClassVar[Op] = Op.UNDO
    back: dict[str, Restore]  # unit → what puts its files back
    stop: tuple[str, ...]
    disable: tuple[str, ...]
    audit: dict[str, Any]
    failed: tuple[str, Failed] | None = None  # the release that failed to start, marked so in its directory

    @property
    def units(self) -> tuple[str, ...]:
        """The units put back or disabled: off the pending list afterwards."""
        return tuple(sorted(self.back)) + self.disable

    def render(self) -> str:
        q = shlex.quote
        lines = ["set -eu", "umask 077"]
        for _, restore in sorted(self.back.items()):
            lines += restore.moves()
        lines.append("systemctl daemon-reload")
        for unit in self.stop + self.disable:
            lines.append(f"systemctl stop {q(unit)} || true")
            lines.append(f"systemctl reset-failed {q(unit)} 2>/dev/null || true")
        if self.disable:
            lines.append("systemctl disable -q " + " ".join(q(u) for u in self.disable) + " || true")
        if self.units:
            lines.append(pending_remove(self.units))
        if self.failed is not None:
            rid, failed = self.failed
            # Written beside the release's record: `releases` shows it and a rollback onto it asks for --force.
            # A release pruned meanwhile has no directory left to mark; a mark that cannot be written (a full
            # disk) must not fail the undo itself.
            where = f"{RELEASES_DIR}/{rid}"
            tmp, final = q(f"{where}/.{FAILED_FILE}"), q(f"{where}/{FAILED_FILE}")
            lines.append(f"if [ -d {q(where)} ]; then {{ printf '%s\\n' {q(json.dumps(failed.to_json()))} > {tmp} "
                         f"&& mv -f {tmp} {final}; }} || true; fi")
        lines.append(audit_line(self.audit))
        return "\n".join(lines) + "\n"


def undo_command(restore: Mapping[str, Release], stop: tuple[str, ...], disable: tuple[str, ...],
                 audit: dict[str, Any], failed: tuple[str, Failed] | None = None) -> Command:
    """Undo a failed change on a host, atomically per file: each unit of `restore` back to its release (see
    Undo); `failed`: the release that failed to start and why, marked on the host."""
    back = {unit: restoring(release, (unit,)) for unit, release in restore.items()}
    return Command(Undo(back, stop, disable, audit, failed), timeout=3600)


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
