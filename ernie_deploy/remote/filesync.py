"""Directory sync over SSH: a manifest kept on the host, content-addressed staging beside the target,
resumable appends, and a switch that swaps the complete new tree in at once (docs/provisioning.md).

The host keeps, per target directory, a manifest of each file's size, sha256 and mtime. A later run reads it
with a `find` of the directory in the probe's one round trip: files whose size and mtime still match are
trusted without hashing. New content is streamed into `STAGE/<sha256>.part` (appended to, so an interrupted
copy resumes where it stopped), checked against its sha256 and renamed to `STAGE/<sha256>`. The switch
builds `TARGET.ernie-next` from hard links (unchanged files and staged ones), then exchanges it with the
target in one `renameat2(RENAME_EXCHANGE)`, so nothing ever sees a half-updated directory.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ernie_deploy.planning.hostpaths import MANIFEST_DIR
from ernie_deploy.planning.provisioning import Entry, HostFile, Manifest, Recorded
from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.programs import program

INCOMPLETE_EXIT = 3  # the stream ended early (interrupted): the .part stays for the next run
MISMATCH_EXIT = 5  # the complete file's sha256 is not the one sent for: the .part is removed


def staging_dir(target: str) -> str:
    """Beside the target, so staged files are on its file system (links and renames, no copies)."""
    return target.rstrip("/") + ".ernie-staging"


def manifest_path(target: str) -> str:
    return f"{MANIFEST_DIR}/{hashlib.sha256(target.encode()).hexdigest()[:16]}.json"


def probe_script(name: str, target: str) -> str:
    """Sections `NAME-kind`, `NAME-manifest`, `NAME-files`, `NAME-staged` and `NAME-disk` (free KiB on the
    nearest existing directory)."""
    q = shlex.quote
    t, stage = q(target), q(staging_dir(target))
    return f"""
m {name}-kind; if [ -L {t} ]; then echo link; elif [ -d {t} ]; then echo dir
  elif [ -e {t} ]; then echo other; else echo absent; fi
m {name}-manifest; cat {q(manifest_path(target))} 2>/dev/null
m {name}-files; [ -d {t} ] && find {t} -type f -printf '%s %T@ %P\\n' 2>/dev/null
m {name}-staged; [ -d {stage} ] && find {stage} -maxdepth 1 -type f -printf '%s %f\\n' 2>/dev/null
m {name}-disk; d={t}; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
df -Pk "$d" 2>/dev/null | awk 'NR==2 {{print $4}}'
"""


@dataclass(frozen=True)
class DirState:
    kind: str  # dir, link, other, absent
    recorded: dict[str, Recorded] = field(default_factory=dict)
    source: str | None = None  # what the recorded manifest says it was synced from
    present: dict[str, HostFile] = field(default_factory=dict)
    staged: dict[str, int] = field(default_factory=dict)  # sha256 → bytes (complete) ; "sha.part" → bytes
    free_bytes: int | None = None


def parse_dir_state(sections: Mapping[str, str], name: str) -> DirState:
    recorded: dict[str, Recorded] = {}
    source = None
    try:
        raw = json.loads(sections.get(f"{name}-manifest", "") or "{}")
        source = raw.get("source")
        for rel, e in dict(raw.get("files", {})).items():
            recorded[str(rel)] = Recorded(int(e["size"]), str(e["sha256"]), str(e["mtime"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        recorded, source = {}, None  # an unreadable manifest vouches for nothing
    present: dict[str, HostFile] = {}
    for line in sections.get(f"{name}-files", "").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].isdigit():
            present[parts[2]] = HostFile(int(parts[0]), parts[1])
    staged: dict[str, int] = {}
    for line in sections.get(f"{name}-staged", "").splitlines():
        size, _, fname = line.partition(" ")
        if size.isdigit() and fname:
            staged[fname] = int(size)
    disk = sections.get(f"{name}-disk", "").strip()
    return DirState(kind=sections.get(f"{name}-kind", "absent").strip() or "absent", recorded=recorded,
                    source=str(source) if source is not None else None, present=present, staged=staged,
                    free_bytes=int(disk) * 1024 if disk.isdigit() else None)


@dataclass(frozen=True)
class HashFiles(Intent):
    """sha256 of the files `rels` under `target` (first contact, or --verify-files); prints `sha256  path`
    lines."""

    op: ClassVar[Op] = Op.HASH_FILES
    target: str
    rels: tuple[str, ...]

    def render(self) -> str:
        q = shlex.quote
        return f"cd {q(self.target)} && sha256sum -- {' '.join(q(r) for r in self.rels)}"


def hash_command(target: str, rels: Iterable[str]) -> Command:
    return Command(HashFiles(target, tuple(rels)), timeout=3600)


@dataclass(frozen=True)
class Receive(Intent):
    """Append the stream (after stdin) to `STAGE/<sha>.part` from `offset`, then check it: complete and
    matching, it becomes `STAGE/<sha>`. A short stream exits INCOMPLETE_EXIT and keeps the part for the next
    run."""

    op: ClassVar[Op] = Op.RECEIVE
    target: str
    entry: Entry
    offset: int

    def render(self) -> str:
        q = shlex.quote
        stage = staging_dir(self.target)
        part, done = f"{stage}/{self.entry.sha256}.part", f"{stage}/{self.entry.sha256}"
        return f"""set -eu
umask 022
mkdir -p {q(posixpath.dirname(stage) or "/")}
umask 077
mkdir -p {q(stage)}
chmod 0700 {q(stage)}
p={q(part)}
[ -f "$p" ] || : > "$p"
truncate -s {self.offset} "$p"
cat >> "$p"
n=$(stat -c %s "$p")
if [ "$n" -lt {self.entry.size} ]; then echo "incomplete $n"; exit {INCOMPLETE_EXIT}; fi
sum=$(sha256sum "$p" | cut -d' ' -f1)
if [ "$n" -ne {self.entry.size} ] || [ "$sum" != {self.entry.sha256} ]; then
  rm -f "$p"; echo "mismatch $n $sum"; exit {MISMATCH_EXIT}
fi
mv -f "$p" {q(done)}
"""


def receive_command(target: str, entry: Entry, offset: int, stream: Iterable[bytes]) -> Command:
    return Command(Receive(target, entry, offset), stream=stream, check=False, timeout=600)


# Run on the host by the switch: the swap in one step, then the new manifest.
_EXCHANGE_PROGRAM = program("exchange")
_MANIFEST_PROGRAM = program("manifest")


@dataclass(frozen=True)
class Switch(Intent):
    """Build the complete new tree (hard links of `keep` from the target, the rest from staging), swap it in,
    record the manifest (`wanted`, from `source`), drop staging. `wanted` is the whole new content; every file
    not in `keep` must be staged already."""

    op: ClassVar[Op] = Op.SWITCH
    target: str
    wanted: Manifest
    keep: frozenset[str]
    owner: str
    source: str
    audit: dict[str, object]

    def render(self) -> str:
        q = shlex.quote
        t, nxt, stage = q(self.target), q(self.target + ".ernie-next"), q(staging_dir(self.target))
        kept = sorted(self.keep)
        lines = ["set -eu", "umask 022", f"rm -rf {nxt}", f"mkdir -p {nxt}"]
        if kept:
            lines.append(f"(cd {t} && cp -al --parents -- {' '.join(q(r) for r in kept)} {nxt}/)")
        for rel in sorted(set(self.wanted) - set(kept)):
            parent = posixpath.dirname(rel)
            if parent:
                lines.append(f"mkdir -p {q(posixpath.join(self.target + '.ernie-next', parent))}")
            lines.append(f"ln -f {q(staging_dir(self.target) + '/' + self.wanted[rel].sha256)} "
                         f"{q(posixpath.join(self.target + '.ernie-next', rel))}")
        lines += [
            f"chown -R {q(self.owner)}: {nxt}",
            f"chmod -R u=rwX,go=rX {nxt}",
            f"entries={stage}/entries.json",
            f"mkdir -p {stage}",
            'cat > "$entries"',
            f"if [ -e {t} ] || [ -L {t} ]; then",
            f"  python3 -c {q(_EXCHANGE_PROGRAM)} {nxt} {t} || {{ mv {t} {t}.ernie-old && mv {nxt} {t} && "
            f"mv {t}.ernie-old {nxt}; }}",
            f"  rm -rf {nxt}",
            "else",
            f"  mkdir -p \"$(dirname {t})\" && mv {nxt} {t}",
            "fi",
            f"find {t} -type f -printf '%s %T@ %P\\n' | python3 -c {q(_MANIFEST_PROGRAM)} \"$entries\" "
            f"{q(manifest_path(self.target))}",
            f"rm -rf {stage}",
            audit_line(self.audit),
        ]
        return "\n".join(lines) + "\n"


def switch_command(target: str, wanted: Manifest, keep: Iterable[str], owner: str, source: str,
                   audit: dict[str, object]) -> Command:
    intent = Switch(target, wanted, frozenset(keep), owner, source, audit)
    entries = {"source": intent.source,
               "files": {rel: {"size": e.size, "sha256": e.sha256} for rel, e in intent.wanted.items()}}
    return Command(intent, stdin=json.dumps(entries).encode(), timeout=600)
