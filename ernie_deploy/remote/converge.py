"""Converge: what must change on a host (pure), and the one script + payload that changes it.

Files are compared by sha256 with what the host has. Uploads travel as a tar stream on stdin (secrets
never touch a command line), are installed as hidden temporary files in the target directory and renamed
into place, so a target file is either the old or the new version, never half written. The previous
version of each replaced file is kept under /var/lib/ernie-deploy/prev for rollback.
"""

from __future__ import annotations

import difflib
import io
import json
import re
import shlex
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import ENV_DIR, UNIT_DIR, RenderedFile
from ernie_deploy.remote.facts import HostFacts

STATE_DIR = "/var/lib/ernie-deploy"
PREV_DIR = f"{STATE_DIR}/prev"
STAGING_DIR = f"{STATE_DIR}/staging"
AUDIT_LOG = "/var/log/ernie-deploy/audit.log"
RUNNING = {"active", "activating", "reloading"}


@dataclass(frozen=True)
class FileChange:
    path: str
    old_sha256: str | None
    new_sha256: str
    mode: int
    secret: bool


@dataclass(frozen=True)
class Changes:
    files: tuple[FileChange, ...] = ()
    restart: tuple[str, ...] = ()  # running units whose unit or env file changed
    start: tuple[str, ...] = ()  # units of the plan that are not running
    enable: tuple[str, ...] = ()  # units not enabled at boot yet
    prune: tuple[str, ...] = ()  # installed units no longer in the plan (only with --prune)
    reasons: dict[str, str] = field(default_factory=dict)  # unit → why it (re)starts

    @property
    def empty(self) -> bool:
        return not (self.files or self.restart or self.start or self.enable or self.prune)

    @property
    def daemon_reload(self) -> bool:
        return any(f.path.endswith(".service") for f in self.files) or bool(self.prune)


def compute_changes(plan: HostPlan, files: list[RenderedFile], facts: HostFacts, prune: bool) -> Changes:
    changed = tuple(FileChange(f.path, facts.files.get(f.path), f.sha256, f.mode, f.secret)
                    for f in files if facts.files.get(f.path) != f.sha256)
    changed_paths = {c.path for c in changed}
    restart, start, enable, reasons = [], [], [], {}
    for inst in plan.instances:
        unit = f"{inst.unit}.service"
        mine = {f"{UNIT_DIR}/{unit}", f"{ENV_DIR}/{inst.unit}.env"} & changed_paths
        state = facts.units.get(unit)
        running = state is not None and state.active_state in RUNNING
        if running and mine:
            restart.append(unit)
            reasons[unit] = "changed: " + ", ".join(sorted(PurePosixPath(p).name for p in mine))
        elif not running:
            start.append(unit)
            reasons[unit] = f"not running ({state.active_state if state else 'not installed'})"
        if state is None or state.unit_file_state != "enabled":
            enable.append(unit)
    planned = {f"{i.unit}.service" for i in plan.instances}
    stale = tuple(sorted(u for u in facts.units if u not in planned)) if prune else ()
    return Changes(changed, tuple(restart), tuple(start), tuple(enable), stale, reasons)


def _staged_name(index: int) -> str:
    return f"f{index}"


def payload(files: list[RenderedFile], changes: Changes, audit: dict[str, object]) -> bytes:
    """The tar stream the apply script reads on stdin: the changed files and the audit line."""
    wanted = {c.path for c in changes.files}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        entries = [(_staged_name(i), f.content.encode()) for i, f in enumerate(files) if f.path in wanted]
        entries.append(("audit.jsonl", (json.dumps(audit, sort_keys=True) + "\n").encode()))
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def apply_script(files: list[RenderedFile], changes: Changes) -> str:
    """One shell script that installs the changed files atomically and (re)starts what changed."""
    q = shlex.quote
    wanted = {c.path for c in changes.files}
    lines = [
        "set -eu",
        "umask 077",
        # Leftovers of a deploy that was killed mid-way (we hold the lock, so nobody else is writing).
        f"rm -rf {STAGING_DIR}; rm -f {UNIT_DIR}/.ernie-vllm-*.new {ENV_DIR}/.ernie-vllm-*.new",
        f"mkdir -p {STAGING_DIR} {ENV_DIR} {PREV_DIR}{UNIT_DIR} {PREV_DIR}{ENV_DIR} {PurePosixPath(AUDIT_LOG).parent}",
        f"chmod 0700 {STATE_DIR} {ENV_DIR}",
        f"trap 'rm -rf {STAGING_DIR}; rm -f {UNIT_DIR}/.ernie-vllm-*.new {ENV_DIR}/.ernie-vllm-*.new' EXIT",
        # A truncated stream (controller killed mid-upload) makes tar fail here, before anything moves.
        f"tar -x -C {STAGING_DIR} -f -",
    ]
    for i, f in enumerate(files):
        if f.path not in wanted:
            continue
        path = PurePosixPath(f.path)
        tmp = path.parent / f".{path.name}.new"
        lines += [
            f"if [ -f {q(f.path)} ]; then cp -p {q(f.path)} {q(PREV_DIR + f.path)}; fi",
            f"install -m {f.mode:04o} -o root -g root {STAGING_DIR}/{_staged_name(i)} {q(str(tmp))}",
            f"mv -f {q(str(tmp))} {q(f.path)}",
        ]
    for unit in changes.prune:
        name = unit.removesuffix(".service")
        lines += [
            f"systemctl disable --now -q {q(unit)} || true",
            f"for f in {UNIT_DIR}/{q(unit)} {ENV_DIR}/{q(name)}.env; do "
            f"if [ -f \"$f\" ]; then cp -p \"$f\" {PREV_DIR}\"$f\"; rm -f \"$f\"; fi; done",
        ]
    lines.append(f"cat {STAGING_DIR}/audit.jsonl >> {AUDIT_LOG}; chmod 0600 {AUDIT_LOG}")
    if changes.daemon_reload:
        lines.append("systemctl daemon-reload")
    if changes.enable:
        lines.append("systemctl enable -q " + " ".join(q(u) for u in changes.enable))
    if changes.restart or changes.start:
        # Where this start's journal begins, for the readiness watch.
        lines.append("printf '@@ernie-deploy:restart-at %s\\n' \"$(date +%s.%N)\"")
    if changes.restart:
        lines.append("systemctl restart " + " ".join(q(u) for u in changes.restart))
    if changes.start:
        lines.append("systemctl start " + " ".join(q(u) for u in changes.start))
    return "\n".join(lines) + "\n"


def read_script(paths: list[str]) -> str:
    """Print the current content of files, for --diff."""
    return "".join(f"echo '@@ernie-deploy:file {p}'; cat {shlex.quote(p)} 2>/dev/null || true\n" for p in paths)


def parse_read(text: str) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines(keepends=True):
        if line.startswith("@@ernie-deploy:file "):
            current = line.split(" ", 1)[1].strip()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "".join(v) for k, v in out.items()}


_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=.*$", re.MULTILINE)


def redact_env(text: str) -> str:
    return _ENV_LINE.sub(r"\1=[REDACTED]", text)


def unified_diff(path: str, old: str | None, new: str, secret: bool) -> str:
    if secret:
        old = redact_env(old) if old is not None else None
        new = redact_env(new)
    diff = "".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=f"{path} (on host)" if old is not None else "/dev/null",
                                        tofile=f"{path} (planned)"))
    if secret and not diff:
        diff = f"--- {path}\n+++ {path}\n (secret values changed; shown as [REDACTED])\n"
    return diff
