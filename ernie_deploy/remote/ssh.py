"""The one door to the network: every SSH connection is made here.

Host keys are checked strictly by default against the user's ~/.ssh/known_hosts plus any known_hosts
file the inventory (`ernie_known_hosts`) or CLI names. fabric's Connection would silently add unknown
keys (it installs paramiko's AutoAddPolicy); we replace that policy before connecting. `accept-new`
(OpenSSH's meaning: record unknown keys, still refuse changed ones) is opt-in and logged.

Jump hosts come from `~/.ssh/config` or from the inventory's SSH argument variables (see route.py);
every hop's host key is checked by the same rules as the target's.

Commands (remote/command.py) run as `sh -c SCRIPT` (or `sudo -n sh -c SCRIPT` with become); data, secrets
included, travels on stdin, never on a command line. HTTP probes of an instance run on the host too
(remote/http.py), so this session is the only way ernie-deploy reaches a host. The one exception uses no
network at all: a host with `ansible_connection: local` is the controller itself, where remote/local.py runs
the same commands.

A host that stops answering (frozen, cut off) sends nothing, not even a TCP reset, so a read would wait for
the command's whole timeout, or longer. While a command runs, the session asks the host for a sign of life
every few seconds, as OpenSSH's ServerAliveInterval/ServerAliveCountMax do (ssh_config(5)), by opening a
channel: sshd answers every channel open, with a confirmation or a failure (RFC 4254 section 5.1), however
long the command stays quiet. A host that answers nothing for `Liveness.limit` seconds (`--host-timeout`) is
UNREACHABLE, its connection is closed at once, and every later command on it fails at once.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import paramiko
from fabric import Config, Connection

from ernie_deploy.errors import DeployError, ExitCode
from ernie_deploy.inventory.coerce import coerce
from ernie_deploy.inventory.connection import ConnectionType, connection_of
from ernie_deploy.remote.command import HOST_TIMEOUT, Command
from ernie_deploy.remote.hostkeys import HostKeyPolicy
from ernie_deploy.remote.route import Route, route_from_vars

log = logging.getLogger(__name__)


class Failure(Enum):
    UNREACHABLE = "unreachable"
    AUTH = "authentication failed"
    HOST_KEY = "host key refused"
    COMMAND = "command failed"


class RemoteError(DeployError):
    """A per-host failure, classified so results and exit codes can tell them apart."""

    def __init__(self, kind: Failure, message: str, *, where: str, hint: str | None = None) -> None:
        super().__init__(f"{kind.value}: {message}", where=where, hint=hint)
        self.kind = kind
        self.exit_code = ExitCode.UNREACHABLE if kind is Failure.UNREACHABLE else ExitCode.FAILED


@dataclass(frozen=True)
class Target:
    """Where and how to reach one inventory host."""

    name: str
    address: str
    port: int = 22
    user: str | None = None
    key_file: str | None = None
    known_hosts: tuple[str, ...] = ()
    become: bool = False
    route: Route = field(default_factory=Route)
    # LOCAL: ansible_connection local, the machine ernie-deploy runs on (remote/local.py); no SSH, so port, user,
    # known_hosts, route and host-key policy do not apply, and become follows the controller's own user.
    connection: ConnectionType = ConnectionType.SSH

    @classmethod
    def from_host(cls, name: str, address: str, port: int, user: str | None, host_vars: Mapping[str, Any],
                  extra_known_hosts: Sequence[str] = ()) -> Target:
        connection = connection_of(name, host_vars)
        if connection is ConnectionType.LOCAL:
            return cls(name=name, address=address, connection=connection)
        files = [str(host_vars["ernie_known_hosts"])] if host_vars.get("ernie_known_hosts") else []
        # An INI inventory gives ansible_become=yes as a string: read it as Ansible's ssh connection does.
        become = coerce(host_vars.get("ansible_become", False), (bool,)) is True or (user not in (None, "root"))
        return cls(name=name, address=address, port=port, user=user,
                   key_file=host_vars.get("ansible_ssh_private_key_file"),
                   known_hosts=tuple(files) + tuple(extra_known_hosts), become=become,
                   route=route_from_vars(host_vars, name))


@dataclass
class RunResult:
    command: str
    code: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh-keygen -lf` prints it."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


def _known_host_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class _Strict(paramiko.MissingHostKeyPolicy):
    def __init__(self, target: Target) -> None:
        self.target = target

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        t = self.target
        files = ", ".join(t.known_hosts) or "~/.ssh/known_hosts"
        raise RemoteError(
            Failure.HOST_KEY, f"unknown host key for {t.address}:{t.port}, offered {fingerprint(key)}", where=t.name,
            hint=(f"check the fingerprint out of band, then add it: ssh-keyscan -p {t.port} {t.address} >> "
                  f"{t.known_hosts[0] if t.known_hosts else '~/.ssh/known_hosts'} (known_hosts read: {files}); "
                  "or rerun with --host-key-policy accept-new"))


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Record an unknown key in the first known_hosts file; changed keys still fail (paramiko raises).
    With record=False (check mode changes nothing, on the controller either) it only says what it would record."""

    def __init__(self, target: Target, record: bool = True) -> None:
        self.target = target
        self.record = record

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        t = self.target
        path = Path(t.known_hosts[0] if t.known_hosts else "~/.ssh/known_hosts").expanduser()
        client.get_host_keys().add(hostname, key.get_name(), key)
        if not self.record:
            log.warning("%s: check mode: accept-new would record host key %s in %s (not written)", t.name,
                        fingerprint(key), path)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"{_known_host_name(t.address, t.port)} {key.get_name()} {key.get_base64()}\n")
        log.warning("%s: accept-new recorded host key %s in %s", t.name, fingerprint(key), path)


Silence = Callable[[float, float], None]  # (seconds without an answer, the limit); 0 s: it answers again


@dataclass(frozen=True)
class Liveness:
    """How long a host may answer nothing while a command runs; it is asked every `interval` seconds."""

    limit: float = HOST_TIMEOUT

    @property
    def interval(self) -> float:
        # Several questions per limit, so a slow answer is not mistaken for none; never a flood.
        return max(0.2, min(15.0, self.limit / 4))


class _Watch:
    """Asks the host for a sign of life while one command runs: each question opens an SSH channel, which
    sshd answers however long the command itself stays quiet. No answer for `limit` seconds since the last
    one closes the connection, which ends the command's reads and writes at once."""

    def __init__(self, transport: paramiko.Transport | None, liveness: Liveness, notify: Silence) -> None:
        self.transport, self.liveness, self.notify = transport, liveness, notify
        self.done = threading.Event()
        self.silent = False

    def __enter__(self) -> _Watch:
        if self.transport is not None:  # None: not connected, nothing to watch (the command fails at once)
            threading.Thread(target=self._loop, args=(self.transport,), name="ssh-liveness", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def _loop(self, transport: paramiko.Transport) -> None:
        interval, limit = self.liveness.interval, self.liveness.limit
        answered, told = time.monotonic(), False
        while not self.done.wait(max(0.0, answered + interval - time.monotonic())):
            answer = threading.Event()
            threading.Thread(target=self._ask, args=(transport, answer), name="ssh-liveness-ask",
                             daemon=True).start()
            while not answer.wait(max(0.0, min(interval, answered + limit - time.monotonic()))):
                if self.done.is_set():
                    return
                quiet = time.monotonic() - answered
                if quiet >= limit:
                    self.silent = True
                    _close_silent(transport)
                    return
                self.notify(quiet, limit)
                told = True
            answered = time.monotonic()
            if told:
                self.notify(0.0, limit)
                told = False

    def _ask(self, transport: paramiko.Transport, answer: threading.Event) -> None:
        try:
            transport.open_session(timeout=self.liveness.limit).close()
        except paramiko.ChannelException:  # sshd refused the channel (MaxSessions): an answer all the same
            pass
        except (paramiko.SSHException, OSError, EOFError):  # no answer in time, or the connection is gone
            return
        answer.set()


def _close_silent(transport: paramiko.Transport) -> None:
    try:
        transport.close()
    except (OSError, paramiko.SSHException, EOFError):
        log.debug("closing a silent connection failed", exc_info=True)


@dataclass
class Session:
    """An open SSH connection to one host; counts the commands it runs (-v prints the count)."""

    target: Target
    connection: Connection
    commands: int = 0
    seconds: float = 0.0
    history: list[str] = field(default_factory=list)
    liveness: Liveness = field(default_factory=Liveness)
    on_silence: Silence | None = None  # told while the host answers nothing (a progress line)
    lost: str | None = None  # why the connection was given up: later commands fail at once

    def run(self, cmd: Command) -> RunResult:
        """Run a command's script on the host (as root via `sudo -n` when the target needs become)."""
        command = f"sh -c {shlex.quote(cmd.script)}"
        if self.target.become:
            command = f"sudo -n -- {command}"
        if self.lost is not None:
            raise RemoteError(Failure.UNREACHABLE, f"{cmd.label} not sent: {self.lost}", where=self.target.name,
                              hint=self._hint())
        self.commands += 1
        self.history.append(cmd.label)
        started = time.monotonic()
        client = self.connection.client
        with _Watch(client.get_transport(), self.liveness, self._quiet) as watch:
            try:
                chan_in, chan_out, chan_err = client.exec_command(command, timeout=cmd.timeout)
                if cmd.stdin:
                    chan_in.write(cmd.stdin)
                for chunk in cmd.stream or ():
                    chan_in.write(chunk)
                chan_in.channel.shutdown_write()
                out, err = _read_both(chan_out, chan_err)
                code = chan_out.channel.recv_exit_status()
            except (TimeoutError, paramiko.SSHException, OSError, EOFError) as exc:
                if not watch.silent:
                    raise RemoteError(Failure.UNREACHABLE, f"connection lost while running {cmd.label}: {exc}",
                                      where=self.target.name) from exc
            finally:
                self.seconds += time.monotonic() - started
        if watch.silent:
            self.lost = f"the host answered nothing for {self.liveness.limit:.0f}s (while running {cmd.label})"
            raise RemoteError(Failure.UNREACHABLE, self.lost, where=self.target.name, hint=self._hint())
        result = RunResult(cmd.label, code, out, err)
        if cmd.check and code != 0:
            raise command_failed(cmd.label, code, err, self.target.name)
        return result

    def _quiet(self, quiet: float, limit: float) -> None:
        if self.on_silence is not None:
            self.on_silence(quiet, limit)

    def _hint(self) -> str:
        return (f"check that {self.target.name} is up and not overloaded; a slow but working host needs a longer "
                f"--host-timeout (now {self.liveness.limit:.0f}s)")

    def close(self) -> None:
        _close_chain(self.connection)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def command_failed(label: str, code: int, stderr: bytes, where: str) -> RemoteError:
    """The error of a checked command that exited non-zero: the end of its stderr, and the fix for sudo."""
    tail = "\n".join(stderr.decode(errors="replace").strip().splitlines()[-5:])
    hint = "the host's sudo needs NOPASSWD for this user" if "sudo:" in tail and "password" in tail else None
    return RemoteError(Failure.COMMAND, f"{label} exited {code}: {tail or '(no stderr)'}", where=where, hint=hint)


def _read_both(chan_out: paramiko.ChannelFile, chan_err: paramiko.ChannelFile) -> tuple[bytes, bytes]:
    """Both streams to their end, read at once: the channel's window only opens as its data is read, so a
    command writing more stderr than the window holds would wait on us while we wait for its stdout (the
    pattern of paramiko #1778)."""
    err: list[bytes] = []
    failed: list[BaseException] = []

    def read_err() -> None:
        try:
            err.append(chan_err.read())
        except BaseException as exc:  # re-raised on the caller's thread, where the run's errors are handled
            failed.append(exc)

    reader = threading.Thread(target=read_err, name="ssh-stderr", daemon=True)
    reader.start()
    try:
        out = chan_out.read()
    finally:
        reader.join()
    if failed:
        raise failed[0]
    return out, err[0]


def _prepare_client(client: paramiko.SSHClient, target: Target, policy: HostKeyPolicy, record: bool = True) -> None:
    default = Path("~/.ssh/known_hosts").expanduser()
    if default.is_file():
        client.load_host_keys(str(default))
    for extra in target.known_hosts:
        path = Path(extra).expanduser()
        if path.is_file():
            client.get_host_keys().load(str(path))
    client.set_missing_host_key_policy(_AcceptNew(target, record) if policy is HostKeyPolicy.ACCEPT_NEW
                                       else _Strict(target))


def connect(target: Target, *, policy: HostKeyPolicy = HostKeyPolicy.STRICT, timeout: float = 10.0,
            retries: int = 2, record: bool = True, host_timeout: float = HOST_TIMEOUT) -> Session:
    """Open a session, retrying only unreachable hosts (bounded, with backoff). record=False: accept-new
    records nothing (check mode). host_timeout: how long the host may answer nothing while a command runs."""
    attempt = 0
    while True:
        try:
            session = _connect_once(target, policy, timeout, record)
            session.liveness = Liveness(host_timeout)
            return session
        except RemoteError as exc:
            if exc.kind is not Failure.UNREACHABLE or attempt >= retries:
                raise
            attempt += 1
            time.sleep(min(0.5 * 2**attempt, 4.0))


def _links(conn: Connection) -> Iterator[Connection]:
    """A connection, then each jump connection behind it (a ProxyCommand gateway is a string: not a link)."""
    link: Any = conn
    while isinstance(link, Connection):
        yield link
        link = link.gateway


def _close_chain(conn: Connection) -> None:
    """Close a connection and every jump connection behind it: fabric closes neither its gateways nor a
    client whose open() failed half-way."""
    for link in _links(conn):
        link.close()
        link.client.close()


def _chain(target: Target, policy: HostKeyPolicy, timeout: float, record: bool = True) -> Connection:
    """The target's Connection with its jump connections behind it, every client holding our host-key policy."""

    def connect_kwargs() -> dict[str, Any]:  # fabric edits these in place: one fresh dict per connection
        kwargs: dict[str, Any] = {"allow_agent": True, "look_for_keys": True, "banner_timeout": timeout,
                                  "auth_timeout": timeout}
        if target.key_file:
            kwargs["key_filename"] = [str(Path(target.key_file).expanduser())]
        return kwargs

    route = target.route
    # None lets fabric apply ~/.ssh/config; False forces a direct connection; a string is a ProxyCommand.
    gateway: Connection | str | bool | None = route.command or (False if route.direct else None)
    for hop in route.hops:  # first hop first: each later hop is reached through the one before
        gateway = Connection(hop.host, user=hop.user, port=hop.port, connect_timeout=timeout,
                             connect_kwargs=connect_kwargs(), config=Config(), gateway=gateway)
    conn = Connection(target.address, user=target.user, port=target.port, connect_timeout=timeout,
                      connect_kwargs=connect_kwargs(), config=Config(), gateway=gateway)
    _prepare_client(conn.client, target, policy, record)
    for link in list(_links(conn))[1:]:  # inventory or ~/.ssh/config hops: the same host-key rules
        _prepare_client(link.client, Target(f"{target.name} (jump host {link.host}:{link.port})", link.host,
                                            link.port, known_hosts=target.known_hosts), policy, record)
    return conn


def _connect_once(target: Target, policy: HostKeyPolicy, timeout: float, record: bool = True) -> Session:
    conn = _chain(target, policy, timeout, record)
    try:
        conn.open()
    except BaseException as exc:
        _close_chain(conn)
        error = _classified(target, exc)
        if error is exc:
            raise
        raise error from exc
    return Session(target, conn)


_ERRNO_REASONS = {errno.ECONNREFUSED: "connection refused (nothing listens on that port)",
                  errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable",
                  errno.ETIMEDOUT: "connection timed out", errno.ECONNRESET: "connection reset by the host"}


def connection_reason(exc: BaseException) -> str:
    """Why a connection failed, in words (paramiko wraps the real errors in one with errno None)."""
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        reasons = sorted({connection_reason(e) for e in exc.errors.values()})
        return "; ".join(reasons) or "connection failed"
    if isinstance(exc, socket.gaierror):
        return f"host name not resolved ({exc.strerror or exc})"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "connection timed out"
    if isinstance(exc, OSError) and exc.errno in _ERRNO_REASONS:
        return _ERRNO_REASONS[exc.errno]
    return str(exc) or type(exc).__name__


def _classified(target: Target, exc: BaseException) -> BaseException:
    """The RemoteError for a failed open(); anything unexpected (Ctrl-C included) is passed on as it is."""
    where, via = target.name, target.route.describe()
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, paramiko.BadHostKeyException):
        files = ", ".join(target.known_hosts) or "~/.ssh/known_hosts"
        jump = exc.hostname != _known_host_name(target.address, target.port)
        who = f"the jump host {exc.hostname}" if jump else target.name
        return RemoteError(
            Failure.HOST_KEY,
            f"host key for {'jump host ' if jump else ''}{exc.hostname} CHANGED: offered "
            f"{fingerprint(exc.key)}, known {fingerprint(exc.expected_key)}", where=where,
            hint=(f"if {who} was reinstalled, verify the new key and replace the old one (ssh-keygen -R "
                  f"{exc.hostname} -f FILE; known_hosts read: {files}); otherwise someone may be intercepting "
                  "the connection"))
    if isinstance(exc, paramiko.AuthenticationException):
        return RemoteError(Failure.AUTH, f"{target.user or 'default user'}@{target.address}{via}: {exc}",
                           where=where, hint="check ansible_user and ansible_ssh_private_key_file, or load the "
                                             "key into ssh-agent")
    if isinstance(exc, (TimeoutError, OSError, paramiko.SSHException, EOFError)):
        return RemoteError(Failure.UNREACHABLE, f"{target.address}:{target.port}{via}: {connection_reason(exc)}",
                           where=where, hint="check that the host (and any jump host) is up and sshd listens there")
    return exc
