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

from ernie_deploy.planning.provisioning import Entry, HostFile, Manifest, Recorded
from ernie_deploy.remote.command import Command, Op
from ernie_deploy.remote.rolling import audit_line
from ernie_deploy.remote.state import STATE_DIR

MANIFEST_DIR = f"{STATE_DIR}/manifests"
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


def hash_command(target: str, rels: Iterable[str]) -> Command:
    """sha256 of host files (first contact, or --verify-files); prints `sha256  path` lines."""
    q = shlex.quote
    names = " ".join(q(r) for r in rels)
    return Command(Op.HASH_FILES, f"cd {q(target)} && sha256sum -- {names}", timeout=3600)


def parse_hashes(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        digest, _, rel = line.partition("  ")
        if len(digest) == 64 and rel:
            out[rel] = digest
    return out


def receive_command(target: str, entry: Entry, offset: int, stream: Iterable[bytes]) -> Command:
    """Append the stream to `STAGE/<sha>.part` from `offset`, then check it: complete and matching, it becomes
    `STAGE/<sha>`. A short stream exits INCOMPLETE_EXIT and keeps the part for the next run."""
    q = shlex.quote
    stage = staging_dir(target)
    part, done = f"{stage}/{entry.sha256}.part", f"{stage}/{entry.sha256}"
    script = f"""set -eu
umask 022
mkdir -p {q(posixpath.dirname(stage) or "/")}
umask 077
mkdir -p {q(stage)}
chmod 0700 {q(stage)}
p={q(part)}
[ -f "$p" ] || : > "$p"
truncate -s {offset} "$p"
cat >> "$p"
n=$(stat -c %s "$p")
if [ "$n" -lt {entry.size} ]; then echo "incomplete $n"; exit {INCOMPLETE_EXIT}; fi
sum=$(sha256sum "$p" | cut -d' ' -f1)
if [ "$n" -ne {entry.size} ] || [ "$sum" != {entry.sha256} ]; then
  rm -f "$p"; echo "mismatch $n $sum"; exit {MISMATCH_EXIT}
fi
mv -f "$p" {q(done)}
"""
    return Command(Op.RECEIVE, script, stream=stream, check=False, timeout=600)


# Runs on the host after the exchange: the new manifest from the entries sent on stdin and `find`'s view of
# the switched-in files (their sizes and mtimes as the next probe will see them). Writes it atomically.
_MANIFEST_PROGRAM = r"""
import json, os, sys
entries = json.loads(open(sys.argv[1]).read())
files = {}
for line in sys.stdin.read().splitlines():
    size, mtime, rel = line.split(" ", 2)
    if rel in entries["files"] and int(size) == entries["files"][rel]["size"]:
        files[rel] = {"size": int(size), "sha256": entries["files"][rel]["sha256"], "mtime": mtime}
out = sys.argv[2]
os.makedirs(os.path.dirname(out), mode=0o700, exist_ok=True)
with open(out + ".tmp", "w") as fh:
    json.dump({"source": entries["source"], "files": files}, fh, sort_keys=True)
os.replace(out + ".tmp", out)
"""

# renameat2(RENAME_EXCHANGE): both paths swap in one step (Linux 3.15+, glibc 2.28+). Exit 1 where the
# kernel or file system cannot, and the script falls back to two renames.
_EXCHANGE_PROGRAM = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fn = getattr(libc, "renameat2", None)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
ok = fn is not None and fn(AT_FDCWD, os.fsencode(sys.argv[1]), AT_FDCWD, os.fsencode(sys.argv[2]), RENAME_EXCHANGE) == 0
sys.exit(0 if ok else 1)
"""


def switch_command(target: str, wanted: Manifest, keep: Iterable[str], owner: str, source: str,
                   audit: dict[str, object]) -> Command:
    """Build the complete new tree (hard links of `keep` from the target, the rest from staging), swap it in,
    record the manifest, drop staging. `wanted` is the whole new content; every file not in `keep` must be
    staged already."""
    q = shlex.quote
    t, nxt, stage = q(target), q(target + ".ernie-next"), q(staging_dir(target))
    kept = sorted(set(keep))
    lines = ["set -eu", "umask 022", f"rm -rf {nxt}", f"mkdir -p {nxt}"]
    if kept:
        lines.append(f"(cd {t} && cp -al --parents -- {' '.join(q(r) for r in kept)} {nxt}/)")
    for rel in sorted(set(wanted) - set(kept)):
        parent = posixpath.dirname(rel)
        if parent:
            lines.append(f"mkdir -p {q(posixpath.join(target + '.ernie-next', parent))}")
        lines.append(f"ln -f {q(staging_dir(target) + '/' + wanted[rel].sha256)} "
                     f"{q(posixpath.join(target + '.ernie-next', rel))}")
    lines += [
        f"chown -R {q(owner)}: {nxt}",
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
        f"{q(manifest_path(target))}",
        f"rm -rf {stage}",
        audit_line(audit),
    ]
    entries = {"source": source, "files": {rel: {"size": e.size, "sha256": e.sha256} for rel, e in wanted.items()}}
    return Command(Op.SWITCH, "\n".join(lines) + "\n", stdin=json.dumps(entries).encode(), timeout=600)
