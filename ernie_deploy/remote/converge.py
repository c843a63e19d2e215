"""Converge: what must change on a host (pure), and the commands that change it, in two steps.

* **stage** puts the changed files in place and records a release, restarting nothing. Uploads travel as a
  tar stream on stdin (secrets never touch a command line), are installed as hidden temporary files in the
  target directory and renamed into place, so a target file is either the old or the new version, never
  half written. Units staged but not activated are listed in the host's pending file, so a later run
  restarts them even though their files already match.
* **activate(units)** runs `daemon-reload` once, enables, starts exactly the given units, and removes the
  units the plan no longer has (with --prune). A restart is a drained stop (remote/rolling.py) and then this
  start; orchestration/cycle.py does them one instance at a time.

Releases (docs/releases.md): every stage that changes a host copies the full set of managed files (all units
and env files, env files 0600) to /var/lib/ernie-deploy/releases/ID/ with a release.json saying who made it
and what changed; the newest `keep` are kept. A release can be restored whole or per instance.
"""

from __future__ import annotations

import difflib
import hashlib
import io
import json
import re
import shlex
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, ClassVar

from ernie_deploy.checks.deaths import Story, last_death, tell
from ernie_deploy.planning.hostpaths import ENV_DIR, RELEASES_DIR, STAGING_DIR, STATE_DIR, UNIT_DIR
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import RenderedFile
from ernie_deploy.remote import audit as auditlog
from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.facts import HostFacts
from ernie_deploy.remote.protocol import MARK, marker, records, split
from ernie_deploy.remote.rolling import GpuRelease, baseline_script
from ernie_deploy.remote.state import pending_add, pending_remove
from ernie_deploy.remote.systemd import restarted_recently, started_at, up_seconds

RUNNING = {"active", "activating", "reloading"}
STARTED_MARK = marker("started")
RELEASE_MARK = marker("release")


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
    restart: tuple[str, ...] = ()  # running units whose unit or env file changed (or were staged, not activated)
    start: tuple[str, ...] = ()  # units of the plan that are not running
    enable: tuple[str, ...] = ()  # units not enabled at boot yet
    prune: tuple[str, ...] = ()  # installed units no longer in the plan (only with --prune)
    reasons: dict[str, str] = field(default_factory=dict)  # unit → why it (re)starts
    leftover: tuple[str, ...] = ()  # installed units the plan no longer has (pruned only with --prune)
    dropins: tuple[str, ...] = ()  # drop-in files overriding our units (systemctl edit): drift
    reload: bool = False  # unit files were changed another way (a release restored): daemon-reload first

    @property
    def empty(self) -> bool:
        return not (self.files or self.restart or self.start or self.enable or self.prune or self.dropins)

    @property
    def daemon_reload(self) -> bool:
        """systemd must reload whatever it holds: a unit file removed (pruned, a drop-in) or restored another way."""
        return self.reload or bool(self.prune) or bool(self.dropins)

    @property
    def written_units(self) -> tuple[str, ...]:
        """The units whose unit file this change writes: systemd reloads for them only if it holds an older one
        (Activate asks it)."""
        return tuple(sorted(PurePosixPath(f.path).name for f in self.files if f.path.endswith(".service")))

    @property
    def units(self) -> tuple[str, ...]:
        """Every unit activation touches: restarted, started."""
        return self.restart + self.start


def serving_problem(unit: str, facts: HostFacts, stable_s: float) -> str | None:
    """Why a unit does not count as serving, or None when it does: active with a main process, not restarted
    by systemd within the stability window, and /health answering 200 on the host."""
    state = facts.units.get(unit)
    if state is None:
        return "not installed"
    story = death_story(unit, facts)
    if state.active_state != "active" or state.main_pid == 0:
        return f"not running ({state.active_state}/{state.sub_state or '-'})" + (f": {story.text}" if story else "")
    if restarted_recently(state, facts.now_us, stable_s):
        up_s = up_seconds(state, facts.now_us) or 0
        if story is not None:
            return f"{story.text}; up only {up_s:.0f}s"
        return f"restarted by systemd {state.n_restarts} time(s), up only {up_s:.0f}s (crash loop?)"
    health = facts.health.get(unit)
    if health != "200":
        return f"running but /health answers {health or 'nothing'}"
    return None


def death_story(unit: str, facts: HostFacts, deploy: str = "ernie-deploy deploy -i INV --limit HOST") -> Story | None:
    """How the unit's engine last died and what followed (checks/deaths.py), from the journal lines the facts read
    of a unit systemd restarted or does not run; None when it has not died since it was last started on request."""
    state = facts.units.get(unit)
    death = last_death(facts.deaths.get(unit, ()))
    if state is None or death is None:
        return None
    return tell(death, active=state.active_state == "active", sub_state=state.sub_state,
                restart_policy=state.restart, deploy=deploy)


def held_gpus(plan: HostPlan, facts: HostFacts, unit: str) -> list[int]:
    """The plan's GPUs that a running unit outside the plan occupies (its CUDA_VISIBLE_DEVICES)."""
    state = facts.units.get(unit)
    if state is None or state.active_state not in RUNNING:
        return []
    needed = {g for inst in plan.instances for g in inst.gpus}
    return sorted(needed & set(facts.unit_gpus.get(unit, ())))


def dropin_unit(path: str) -> str:
    """The unit a drop-in file belongs to (/etc/systemd/system/U.service.d/x.conf → U.service)."""
    return PurePosixPath(path).parent.name.removesuffix(".d")


def compute_changes(plan: HostPlan, files: list[RenderedFile], facts: HostFacts, prune: bool,
                    stable_s: float = 10.0) -> Changes:
    changed = tuple(FileChange(f.path, facts.files.get(f.path), f.sha256, f.mode, f.secret)
                    for f in files if facts.files.get(f.path) != f.sha256)
    changed_paths = {c.path for c in changed}
    restart, start, enable, reasons = [], [], [], {}
    for inst in plan.instances:
        unit = f"{inst.unit}.service"
        mine = {f"{UNIT_DIR}/{unit}", f"{ENV_DIR}/{inst.unit}.env"} & changed_paths
        state = facts.units.get(unit)
        running = state is not None and state.active_state in RUNNING
        problem = serving_problem(unit, facts, stable_s)
        if running and mine:
            restart.append(unit)
            reasons[unit] = "changed: " + ", ".join(sorted(PurePosixPath(p).name for p in mine))
        elif running and unit in facts.pending:
            restart.append(unit)
            reasons[unit] = "staged by an earlier run but not restarted since"
        elif running and state is not None and state.need_daemon_reload:
            restart.append(unit)
            reasons[unit] = "its unit file changed on disk after systemd loaded it (not in effect)"
        elif running and state is not None and newer_than_process(unit, facts):
            restart.append(unit)
            reasons[unit] = f"{', '.join(newer_than_process(unit, facts))} changed after it started (not in effect)"
        elif running and prune and any(dropin_unit(d) == unit for d in facts.dropins):
            restart.append(unit)
            reasons[unit] = "drop-in removed (--prune): " + ", ".join(
                d for d in sorted(facts.dropins) if dropin_unit(d) == unit)
        elif running and problem is not None:
            restart.append(unit)
            reasons[unit] = problem
        elif not running:
            start.append(unit)
            reasons[unit] = problem or "not running"
        if state is None or state.unit_file_state != "enabled":
            enable.append(unit)
    planned = {f"{i.unit}.service" for i in plan.instances}
    leftover = tuple(sorted(u for u in facts.units if u not in planned))
    stale = any(facts.units[u].need_daemon_reload for u in planned if u in facts.units)
    return Changes(changed, tuple(restart), tuple(start), tuple(enable), leftover if prune else (), reasons,
                   leftover=leftover, dropins=tuple(sorted(facts.dropins)), reload=stale)


# mtimes have whole seconds and the process start is estimated from two clocks: a file counts as newer only
# beyond this margin, so a restart right after a stage never reads as "changed since".
CLOCK_MARGIN_S = 1.5


def newer_than_process(unit: str, facts: HostFacts) -> list[str]:
    """The unit's files (unit, env) modified after its running process started: edits not in effect."""
    return changed_after_start(unit, facts, facts.mtimes) or []


def changed_after_start(unit: str, facts: HostFacts, times: Mapping[str, int]) -> list[str] | None:
    """The unit's files (unit, env) whose time in `times` (the facts' mtimes or ctimes) is after its process
    started; None when that cannot be told (no start time, or no time read for either file)."""
    state = facts.units.get(unit)
    start = started_at(state, facts.now_us, facts.wall_now) if state is not None else None
    paths = [p for p in (f"{UNIT_DIR}/{unit}", f"{ENV_DIR}/{unit.removesuffix('.service')}.env") if p in times]
    if start is None or not paths:
        return None
    return [PurePosixPath(p).name for p in paths if times[p] > start + CLOCK_MARGIN_S]


def release_id(files: list[RenderedFile], now: float) -> str:
    """Time (UTC to the millisecond, sortable) plus a short hash of the full managed set."""
    digest = hashlib.sha256("".join(f"{f.path}\0{f.sha256}\n" for f in sorted(files, key=lambda f: f.path))
                            .encode()).hexdigest()[:8]
    # Milliseconds: ids sort by time on the host (listing, pruning, "the one before"), also for two
    # changes within one second.
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z-{digest}"


def _staged_name(index: int) -> str:
    return f"f{index}"


def payload(files: list[RenderedFile], changes: Changes, audit: dict[str, Any], release: dict[str, Any]) -> bytes:
    """The tar stream the stage script reads on stdin: the changed files, the audit line, the release record."""
    wanted = {c.path for c in changes.files}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        entries = [(_staged_name(i), f.content.encode()) for i, f in enumerate(files) if f.path in wanted]
        entries.append(("audit.jsonl", auditlog.encode(audit).encode()))
        entries.append(("release.json", (json.dumps(release, sort_keys=True, indent=1) + "\n").encode()))
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _cleanup() -> str:
    return f"rm -rf {STAGING_DIR}; rm -f {UNIT_DIR}/.ernie-vllm-*.new {ENV_DIR}/.ernie-vllm-*.new"


@dataclass(frozen=True)
class StagedFile:
    path: str
    member: str  # its name in the tar stream on stdin
    mode: int


@dataclass(frozen=True)
class Stage(Intent):
    """Install `files` atomically from the tar stream on stdin, mark the `pending` units (unit → the release it
    runs now, when known) and record release `release` of every `managed` file; keep the newest `keep`
    releases and every one in `protect`. Restarts nothing. With `gpu_units`, then read their GPUs (GpuRelease)."""

    op: ClassVar[Op] = Op.STAGE
    files: tuple[StagedFile, ...]
    pending: dict[str, str | None]
    release: str
    managed: tuple[str, ...]
    keep: int
    protect: tuple[str, ...] = ()
    gpu_units: tuple[str, ...] = ()

    def render(self) -> str:
        q = shlex.quote
        rdir = f"{RELEASES_DIR}/{self.release}"
        lines = [
            "set -eu",
            "umask 077",
            # Leftovers of a run that was killed mid-way (we hold the lock, so nobody else is writing).
            _cleanup(),
            f"mkdir -p {STAGING_DIR} {ENV_DIR} {RELEASES_DIR} {auditlog.AUDIT_DIR}",
            f"chmod 0700 {STATE_DIR} {ENV_DIR} {RELEASES_DIR}",
            f"trap '{_cleanup()}' EXIT",
            # A truncated stream (controller killed mid-upload) makes tar fail here, before anything moves.
            f"tar -x -C {STAGING_DIR} -f -",
        ]
        for f in self.files:
            path = PurePosixPath(f.path)
            tmp = path.parent / f".{path.name}.new"
            lines += [
                f"install -m {f.mode:04o} -o root -g root {STAGING_DIR}/{f.member} {q(str(tmp))}",
                f"mv -f {q(str(tmp))} {q(f.path)}",
            ]
        lines += pending_add(self.pending)
        # The release: every managed file as it now is on the host, copied with its mode (env files stay 0600).
        lines += [f"rm -rf {q(rdir)}.tmp {q(rdir)}", f"mkdir -p {q(rdir)}.tmp{UNIT_DIR} {q(rdir)}.tmp{ENV_DIR}"]
        lines += [f"cp -p {q(p)} {q(rdir + '.tmp' + p)}" for p in self.managed]
        lines += [f"cp {STAGING_DIR}/release.json {q(rdir)}.tmp/release.json", f"mv {q(rdir)}.tmp {q(rdir)}",
                  # Newest `keep` releases stay (ids sort by time), and every release a unit runs now (`protect`).
                  f"ls -1 {RELEASES_DIR} | grep -v '\\.tmp$' | sort | head -n -{max(1, self.keep)} | "
                  f"grep -vxF -e {q(self.release)} " + "".join(f"-e {q(p)} " for p in self.protect) + "| "
                  f"while read -r old; do rm -rf {RELEASES_DIR}/\"$old\"; done",
                  auditlog.append_from(f"{STAGING_DIR}/audit.jsonl"),
                  f"printf '{RELEASE_MARK}%s\\n' {q(self.release)}"]
        if self.gpu_units:
            # Staged: a reading that fails (no nvidia-smi) is the GPU gate's to judge, not a failed stage.
            lines += ["set +e", GpuRelease(self.gpu_units).render().rstrip("\n"), "true"]
        return "\n".join(lines) + "\n"


def stage_command(files: list[RenderedFile], changes: Changes, audit: dict[str, Any], release: dict[str, Any],
                  keep: int, protect: tuple[str, ...] = (), ran: dict[str, str] | None = None,
                  gpu_units: Sequence[str] = ()) -> Command:
    """Install the changed files atomically, mark their units pending (with `ran`: unit → the release it runs
    now) and record the release; restart nothing. Releases in `protect` (what the units run now: a failed
    start goes back to them) are never pruned. With `gpu_units` (units about to start with nothing to stop
    first), read their GPUs right after (rolling.parse_gpus reads the output): the GPU gate's first reading
    without a round trip of its own."""
    ran = ran or {}
    wanted = {c.path for c in changes.files}
    staged = tuple(StagedFile(f.path, _staged_name(i), f.mode) for i, f in enumerate(files) if f.path in wanted)
    intent = Stage(staged, {u: ran.get(u) for u in changes.units}, str(release["id"]), tuple(f.path for f in files),
                   keep, protect, tuple(gpu_units))
    return Command(intent, stdin=payload(files, changes, audit, release), timeout=300)


@dataclass(frozen=True)
class Activate(Intent):
    """Prune `prune` (and remove `dropins`), daemon-reload once when asked (`daemon_reload`), or when systemd
    holds an older copy of a unit file in `written` (else it reads a unit it does not hold from disk when it is
    started: a reload re-reads every unit, 0.1 s on a lab host and more on a host with many units), enable
    `enable`, start exactly `start` and print each new run's invocation; `baselines` (unit → its GPUs): record
    their used memory before that unit starts."""

    op: ClassVar[Op] = Op.ACTIVATE
    start: tuple[str, ...]
    audit: dict[str, Any]
    enable: tuple[str, ...] = ()
    prune: tuple[str, ...] = ()
    dropins: tuple[str, ...] = ()
    daemon_reload: bool = False
    baselines: dict[str, tuple[int, ...]] = field(default_factory=dict)
    written: tuple[str, ...] = ()

    def render(self) -> str:
        q = shlex.quote
        lines = ["set -eu"]
        for unit in self.prune:
            name = unit.removesuffix(".service")
            # The files are in the previous release already; removing them is enough.
            lines += [f"systemctl disable --now -q {q(unit)} || true",
                      f"rm -f {UNIT_DIR}/{q(unit)} {ENV_DIR}/{q(name)}.env"]
        if self.dropins:
            # Only with --prune: deploy refuses a host with drop-ins otherwise (drift it would not see).
            lines.append("rm -f " + " ".join(q(d) for d in self.dropins))
            lines.append("rmdir " + " ".join(sorted({q(str(PurePosixPath(d).parent)) for d in self.dropins}))
                         + " 2>/dev/null || true")
        if self.enable:
            # enable reloads the manager itself unless told not to (systemctl(1), --no-reload); the reload below
            # (when one is due) covers it. enable works from the unit files on disk, so it needs none before it.
            no_reload = "--no-reload " if self.daemon_reload or self.written else ""
            lines.append(f"systemctl enable -q {no_reload}" + " ".join(q(u) for u in self.enable))
        if self.daemon_reload:
            lines.append("systemctl daemon-reload")
        elif self.written:
            # systemd says NeedDaemonReload=yes for a unit it holds from an older file, and not-found for one it
            # keeps as missing (before 246 it never looks again); a unit it does not hold (new, or inactive and
            # unreferenced) it loads from disk on this very query. Anything else, or no answer: reload.
            units = " ".join(q(u) for u in self.written)
            lines.append(f"s=$(systemctl show -p LoadState,NeedDaemonReload --value {units}) && "
                         "! printf '%s\\n' \"$s\" | grep -qvxE 'loaded|no|' || systemctl daemon-reload")
        for unit in self.start:
            if unit in self.baselines:
                lines.append(baseline_script(unit, self.baselines[unit]))
        if self.start:
            # The unit's StartLimitBurst= bounds systemd's own restarts of a dying engine; a start asked for here
            # must not be refused by restarts of the past, so it clears the count (and a failed state) first.
            units = " ".join(q(u) for u in self.start)
            lines.append(f"systemctl reset-failed {units} 2>/dev/null || true")
            lines.append("systemctl start " + units)
        for unit in self.start:
            # The new run of each unit: the readiness watch reads exactly its journal lines, and counts the
            # automatic restarts after this one.
            lines.append(f"printf '{STARTED_MARK}%s %s %s\\n' {q(unit)} "
                         f"\"$(systemctl show -p InvocationID --value {q(unit)})\" "
                         f"\"$(systemctl show -p NRestarts --value {q(unit)})\"")
        if self.start or self.prune:
            lines.append(pending_remove(self.start + self.prune))
        lines.append(audit_line(self.audit))
        return "\n".join(lines) + "\n"


def activate_command(changes: Changes, audit: dict[str, Any],
                     gpus: dict[str, tuple[int, ...]] | None = None) -> Command:
    """Prune, daemon-reload once, enable, start exactly `changes.start`; print each new run's invocation.
    A restart is a stop (remote/rolling.py, after the drain) and then this start, with the GPU release gate in
    between, so `changes.restart` is not acted on here. `gpus` (unit → its GPUs): record their used memory
    before each unit starts (the baseline the gate waits for after its next stop)."""
    baselines = {u: (gpus or {})[u] for u in changes.start if (gpus or {}).get(u)}
    return Command(Activate(changes.start, audit, changes.enable, changes.prune, changes.dropins,
                            changes.daemon_reload, baselines, changes.written_units))


@dataclass(frozen=True)
class Started:
    invocation: str  # systemd's InvocationID of the new run
    restarts: int  # NRestarts right after the (re)start: the watch counts automatic restarts beyond it


def started_units(output: str) -> dict[str, Started]:
    """What activate printed about each unit it (re)started; a unit missing here cannot be verified."""
    out = {}
    for record in records(output, "started"):
        parts = record.split()
        if len(parts) == 3 and parts[1] and parts[2].isdigit():
            out[parts[0]] = Started(parts[1], int(parts[2]))
    return out


@dataclass(frozen=True)
class ReadFiles(Intent):
    """Print the current content of `paths`, each after its marker line."""

    op: ClassVar[Op] = Op.READ_FILES
    paths: tuple[str, ...]

    def render(self) -> str:
        return "".join(f"echo '{MARK}file {p}'; cat {shlex.quote(p)} 2>/dev/null || true\n"
                       for p in self.paths)


def read_command(paths: list[str]) -> Command:
    """Print the current content of files, for --diff."""
    return Command(ReadFiles(tuple(paths)))


def parse_read(text: str) -> dict[str, str]:
    """Each file's content exactly as printed, by path."""
    return {s.arg: "".join(s.raw) for s in split(text) if s.kind == "file"}


_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=.*$", re.MULTILINE)


def redact_env(text: str) -> str:
    return _ENV_LINE.sub(r"\1=[REDACTED]", text)


def unified_diff(path: str, old: str | None, new: str, secret: bool, new_label: str = "planned") -> str:
    if secret:
        old = redact_env(old) if old is not None else None
        new = redact_env(new)
    diff = "".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=f"{path} (on host)" if old is not None else "/dev/null",
                                        tofile=f"{path} ({new_label})"))
    if secret and not diff:
        diff = f"--- {path}\n+++ {path}\n (secret values changed; shown as [REDACTED])\n"
    return diff


def moved_gpus(plan: HostPlan, facts: HostFacts) -> list[str]:
    """Why this host's instances cannot restart one at a time: a planned instance would take GPUs that another
    running unit (ours) holds now, or runs on other GPUs than planned. Empty when each can go alone."""
    # A unit without CUDA_VISIBLE_DEVICES (not written by us) says nothing about its GPUs.
    running = {u: set(facts.unit_gpus[u]) for u, s in facts.units.items()
               if s.active_state in RUNNING and facts.unit_gpus.get(u)}
    planned = {f"{i.unit}.service": set(i.gpus) for i in plan.instances}
    why = []
    for inst in plan.instances:
        unit, wanted = f"{inst.unit}.service", set(inst.gpus)
        if unit in running and running[unit] != wanted:
            why.append(f"{unit} moves from GPU(s) {_ids(running[unit])} to {_ids(wanted)}")
        for other, held in running.items():
            # Instances the plan itself puts on shared GPUs (vllm_share_gpus) are not in each other's way.
            if other != unit and held & wanted and not (planned.get(other, set()) & wanted):
                why.append(f"{unit} needs GPU(s) {_ids(held & wanted)}, held now by {other}")
    return why


def _ids(gpus: set[int]) -> str:
    return ",".join(str(g) for g in sorted(gpus))
