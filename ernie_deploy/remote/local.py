"""The transport for `ansible_connection: local`: a host's commands run on this machine, without SSH.

The same typed commands as over SSH (remote/command.py), run the same way: the intent's script is one
argument of `/bin/sh -c SCRIPT`, prefixed by `sudo -n --` when ernie-deploy does not run as root (ssh.py's
rule for a login that is not root: the units and files it manages are root's; `-n` fails at once where sudo
would ask for a password). No shell parses the outer line, so nothing in a script is interpreted twice. Data
and secrets travel on the script's stdin (file copies stream after it), never on a command line; so the deploy
lock, releases and audit log land where they do on any host, because the scripts that write them are the same.

What does not apply: there is no connection, so no host key (--host-key-policy, known_hosts and
ernie_known_hosts are not read), no jump host, no --host-timeout (this machine cannot stop answering while a
command runs; the command's own timeout bounds it), and no ansible_user: like Ansible's local connection, the
commands run as the user who started ernie-deploy (with sudo when that is not root).

A command gets a login's environment, not the controller's (sshd gives each command a fresh one): the venv
ernie-deploy runs in, a PYTHONPATH or a secret in the caller's environment must not change which `python3` or
`systemctl` a host script finds, nor reach it. It runs in its own session, as a command over SSH does: a
Ctrl-C at the terminal reaches ernie-deploy, whose fleet runner lets running commands finish and then releases
the lock, not the script (a staging script is never cut in half).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO

from ernie_deploy.inventory.connection import ConnectionType
from ernie_deploy.remote.command import Command
from ernie_deploy.remote.ssh import Failure, RemoteError, RunResult, Target, command_failed

log = logging.getLogger(__name__)

# The PATH a root login gets from sshd and sudo's secure_path on Debian and RHEL alike.
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SUDO = ("sudo", "-n", "--")
_KILL_GRACE = 5.0  # seconds a timed-out command has between SIGTERM and SIGKILL


def login_env() -> dict[str, str]:
    """What a fresh login of the current user would start with."""
    uid = os.geteuid()
    try:
        entry = pwd.getpwuid(uid)
        home, user = entry.pw_dir, entry.pw_name
    except KeyError:  # a uid without a passwd entry (some containers): still a usable environment
        home, user = "/", str(uid)
    return {"PATH": LOGIN_PATH, "HOME": home, "USER": user, "LOGNAME": user, "SHELL": "/bin/sh"}


@dataclass
class LocalSession:
    """Runs one host's commands on this machine; counts them as an SSH session does (-v prints the count)."""

    target: Target
    sudo: bool = False  # not root: each script runs under `sudo -n`
    env: Mapping[str, str] = field(default_factory=login_env)
    commands: int = 0
    seconds: float = 0.0
    history: list[str] = field(default_factory=list)

    def argv(self, cmd: Command) -> list[str]:
        line = ["/bin/sh", "-c", cmd.script]
        return [*SUDO, *line] if self.sudo else line

    def run(self, cmd: Command) -> RunResult:
        """Run a command's script here (as root via `sudo -n` when ernie-deploy is not root)."""
        self.commands += 1
        self.history.append(cmd.label)
        started = time.monotonic()
        try:
            code, out, err = _execute(self.argv(cmd), cmd, self.env)
        except FileNotFoundError as exc:
            raise RemoteError(Failure.COMMAND, f"{cmd.label} not started: {exc.filename} not found",
                              where=self.target.name, hint=_SUDO_HINT if self.sudo else None) from exc
        finally:
            self.seconds += time.monotonic() - started
        if code is None:
            raise RemoteError(Failure.COMMAND, f"{cmd.label} ran past its timeout of {cmd.timeout:g}s and was stopped",
                              where=self.target.name,
                              hint="see what it waits for on this machine (journalctl, ps); a slow step may need a "
                                   "longer budget (--startup-budget, a task's timeout)")
        if cmd.check and code != 0:
            raise command_failed(cmd.label, code, err, self.target.name)
        return RunResult(cmd.label, code, out, err)

    def close(self) -> None:
        """Nothing stays open between commands."""


_SUDO_HINT = "run ernie-deploy as root, or install sudo and give this user NOPASSWD rights"


def connect(target: Target) -> LocalSession:
    """The session for a local target: as root the scripts run directly, otherwise under `sudo -n`."""
    if target.connection is not ConnectionType.LOCAL:
        raise ValueError(f"{target.name} is reached over SSH, not locally")
    sudo = os.geteuid() != 0
    if sudo and shutil.which("sudo", path=LOGIN_PATH) is None:
        raise RemoteError(Failure.COMMAND, "ernie-deploy does not run as root and sudo is not installed",
                          where=target.name, hint=_SUDO_HINT)
    log.info("%s: ansible_connection local: commands run on this machine%s, without SSH (host-key policy, "
             "known_hosts and --host-timeout do not apply)", target.name, " under sudo -n" if sudo else "")
    return LocalSession(target, sudo=sudo)


def _execute(argv: list[str], cmd: Command, env: Mapping[str, str]) -> tuple[int | None, bytes, bytes]:
    """Exit code (None: killed at its timeout), stdout and stderr. stdin is fed and both outputs are read on
    their own threads: a script that writes much before reading its input must not wait on us, nor we on it."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env), cwd=_home(env), start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out: list[bytes] = []
    err: list[bytes] = []
    failed: list[BaseException] = []
    threads = [threading.Thread(target=_feed, args=(proc.stdin, cmd, failed), name="local-stdin", daemon=True),
               threading.Thread(target=_drain, args=(proc.stdout, out), name="local-stdout", daemon=True),
               threading.Thread(target=_drain, args=(proc.stderr, err), name="local-stderr", daemon=True)]
    for thread in threads:
        thread.start()
    try:
        code: int | None = proc.wait(timeout=cmd.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        code = None
    except BaseException:  # Ctrl-C while waiting: the script is ours to end, as a closed SSH channel ends it
        _stop(proc)
        raise
    for thread in threads:
        # A killed script's own children may still hold its output open: after a timeout, wait only so long.
        thread.join(None if code is not None else _KILL_GRACE)
    if failed:  # the stream of a file copy broke: what the script got is incomplete
        raise failed[0]
    return code, b"".join(out), b"".join(err)


def _home(env: Mapping[str, str]) -> str:
    """Where the command starts, as a login starts in its home; `/` for a user whose home does not exist."""
    home = env.get("HOME", "/")
    return home if os.path.isdir(home) else "/"


def _feed(pipe: IO[bytes], cmd: Command, failed: list[BaseException]) -> None:
    try:
        if cmd.stdin:
            pipe.write(cmd.stdin)
        for chunk in cmd.stream or ():
            pipe.write(chunk)
    except BrokenPipeError:
        pass  # the script stopped reading its input: its exit code says whether that was wrong
    except BaseException as exc:  # re-raised on the caller's thread, where the run's errors are handled
        failed.append(exc)
    finally:
        with contextlib.suppress(BrokenPipeError):
            pipe.close()


def _drain(pipe: IO[bytes], into: list[bytes]) -> None:
    into.append(pipe.read())
    pipe.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the script and everything it started (its own process group): SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, _KILL_GRACE), (signal.SIGKILL, None)):
        # ProcessLookupError: gone already; PermissionError: root's under sudo, which passes SIGTERM on to them
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
