"""The deploy lock on each host: an atomic `mkdir` plus a details file, released in `finally`.

A second deploy finds the directory and gets the holder's details; `--lock-wait` retries the same
atomic step. The token makes the lock re-entrant for one run and lets `lock --break` name what it breaks.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import socket
import time
import uuid
from dataclasses import dataclass
from typing import ClassVar

from ernie_deploy.errors import DeployError
from ernie_deploy.planning.hostpaths import LOCK_DIR, STATE_DIR
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.protocol import MARK
from ernie_deploy.remote.ssh import RunResult

HELD_EXIT = 75  # EX_TEMPFAIL: the script's way of saying "someone else holds it"
NOT_OURS_EXIT = 76  # release: another run holds the lock now (its details follow)
GONE_EXIT = 77  # release: no lock at all


@dataclass(frozen=True)
class LockInfo:
    token: str
    user: str
    controller: str
    pid: int
    command: str
    since: float

    @classmethod
    def mine(cls, command: str) -> LockInfo:
        return cls(uuid.uuid4().hex, getpass.getuser(), socket.gethostname(), os.getpid(), command, time.time())

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        stale = " — stale: that process no longer runs on this controller" if self.liveness() == "dead" else ""
        return f"held by {self.user}@{self.controller} (pid {self.pid}) since {when}: {self.command}{stale}"

    def liveness(self) -> str:
        """"alive" or "dead" when the holder ran on this controller (its pid tells), else "unknown"."""
        if self.controller != socket.gethostname():
            return "unknown"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:  # exists, owned by someone else
            return "alive"
        return "alive"


def parse_info(text: str | None) -> LockInfo | None:
    if not text:
        return None
    try:
        data = json.loads(text)
        return LockInfo(str(data["token"]), str(data["user"]), str(data["controller"]), int(data["pid"]),
                        str(data["command"]), float(data["since"]))
    except (ValueError, KeyError, TypeError):
        return None


def acquire_script(info: LockInfo) -> str:
    """Take the lock (or find it is ours already); exit HELD_EXIT with the holder's details otherwise."""
    q = shlex.quote
    return f"""
mkdir -p {STATE_DIR} && chmod 0755 {STATE_DIR}
if mkdir {LOCK_DIR} 2>/dev/null; then
  printf '%s\\n' {q(info.to_json())} > {LOCK_DIR}/info.tmp && mv -f {LOCK_DIR}/info.tmp {LOCK_DIR}/info
elif ! grep -q {q(info.token)} {LOCK_DIR}/info 2>/dev/null; then
  echo "{MARK}lock-held"; cat {LOCK_DIR}/info 2>/dev/null; exit {HELD_EXIT}
fi
"""


def release_script(token: str) -> str:
    """Remove the lock if it is still ours; otherwise say whose it is (NOT_OURS_EXIT) or that it is gone
    (GONE_EXIT), and a failed removal exits with rm's status."""
    q = shlex.quote
    return (f"if grep -q {q(token)} {LOCK_DIR}/info 2>/dev/null; then rm -rf {LOCK_DIR}; "
            f"elif [ -e {LOCK_DIR} ]; then cat {LOCK_DIR}/info 2>/dev/null; exit {NOT_OURS_EXIT}; "
            f"else exit {GONE_EXIT}; fi")


def check_release(result: RunResult, where: str) -> None:
    """Raise when the release did not remove our lock: a lock left behind blocks the next deploy, and one
    taken over by another run means two ran at once."""
    if result.code == 0:
        return
    if result.code == NOT_OURS_EXIT:
        holder = parse_info(result.text.strip())
        raise DeployError(f"the lock is not ours any more: {holder.describe() if holder else 'held, no details'}",
                          where=where)
    if result.code == GONE_EXIT:
        raise DeployError(f"{LOCK_DIR} was gone already (removed by `lock --break`?)", where=where)
    tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {result.code}"]
    raise DeployError(f"removing {LOCK_DIR} failed: {tail[0]}", where=where,
                      hint=f"remove it by hand once no deploy runs: rm -rf {LOCK_DIR}")


@dataclass(frozen=True)
class Acquire(Intent):
    """Take the lock for `info` (or find it is ours already), then run `then` in the same round trip."""

    info: LockInfo
    then: Intent

    @property
    def op(self) -> Op:
        # Facts read under the lock have a name of their own; the provisioning probe's name says so already.
        return Op.LOCK_FACTS if self.then.op is Op.FACTS else self.then.op

    def render(self) -> str:
        return acquire_script(self.info) + self.then.render()


@dataclass(frozen=True)
class ReleaseLock(Intent):
    op: ClassVar[Op] = Op.RELEASE_LOCK
    token: str

    def render(self) -> str:
        return release_script(self.token)


@dataclass(frozen=True)
class ShowLock(Intent):
    op: ClassVar[Op] = Op.SHOW_LOCK

    def render(self) -> str:
        return f"cat {LOCK_DIR}/info 2>/dev/null || true"


@dataclass(frozen=True)
class BreakLock(Intent):
    """Remove the lock, but only the one that was shown (its token; None: a half-taken lock, no details file),
    so a newer holder is never broken."""

    op: ClassVar[Op] = Op.BREAK_LOCK
    token: str | None

    def render(self) -> str:
        if self.token is None:
            return f"if [ ! -s {LOCK_DIR}/info ]; then rm -rf {LOCK_DIR}; fi"
        return f"if grep -q {shlex.quote(self.token)} {LOCK_DIR}/info 2>/dev/null; then rm -rf {LOCK_DIR}; fi"


def acquire_command(info: LockInfo, then: Intent) -> Command:
    """Take the lock and run `then` (a facts read) in the same round trip."""
    return Command(Acquire(info, then), check=False)


def release_command(token: str) -> Command:
    return Command(ReleaseLock(token), check=False)


SHOW = Command(ShowLock())


def break_command(token: str | None) -> Command:
    return Command(BreakLock(token))
