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

from ernie_deploy.remote.command import Command, Op

LOCK_ROOT = "/var/lib/ernie-deploy"
LOCK_DIR = f"{LOCK_ROOT}/lock"
HELD_EXIT = 75  # EX_TEMPFAIL: the script's way of saying "someone else holds it"


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
mkdir -p {LOCK_ROOT} && chmod 0755 {LOCK_ROOT}
if mkdir {LOCK_DIR} 2>/dev/null; then
  printf '%s\\n' {q(info.to_json())} > {LOCK_DIR}/info.tmp && mv -f {LOCK_DIR}/info.tmp {LOCK_DIR}/info
elif ! grep -q {q(info.token)} {LOCK_DIR}/info 2>/dev/null; then
  echo "@@ernie-deploy:lock-held"; cat {LOCK_DIR}/info 2>/dev/null; exit {HELD_EXIT}
fi
"""


def release_script(token: str) -> str:
    q = shlex.quote
    return f"if grep -q {q(token)} {LOCK_DIR}/info 2>/dev/null; then rm -rf {LOCK_DIR}; fi"


def acquire_command(info: LockInfo, then: str, op: Op = Op.LOCK_FACTS) -> Command:
    """Take the lock and run `then` (the facts script) in the same round trip."""
    return Command(op, acquire_script(info) + then, check=False)


def release_command(token: str) -> Command:
    return Command(Op.RELEASE_LOCK, release_script(token), check=False)


SHOW = Command(Op.SHOW_LOCK, f"cat {LOCK_DIR}/info 2>/dev/null || true")
def break_command(token: str | None) -> Command:
    """Remove the lock, but only the one that was shown (its token), so a newer holder is never broken."""
    if token is None:  # no details file: a half-taken lock
        return Command(Op.BREAK_LOCK, f"if [ ! -s {LOCK_DIR}/info ]; then rm -rf {LOCK_DIR}; fi")
    return Command(Op.BREAK_LOCK, f"if grep -q {shlex.quote(token)} {LOCK_DIR}/info 2>/dev/null; then "
                                  f"rm -rf {LOCK_DIR}; fi")
