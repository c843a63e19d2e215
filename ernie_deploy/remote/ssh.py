"""The one door to the network: every SSH connection is made here.

Host keys are checked strictly by default against the user's ~/.ssh/known_hosts plus any known_hosts
file the inventory (`ernie_known_hosts`) or CLI names. fabric's Connection would silently add unknown
keys (it installs paramiko's AutoAddPolicy); we replace that policy before connecting. `accept-new`
(OpenSSH's meaning: record unknown keys, still refuse changed ones) is opt-in and logged.

Jump hosts come from `~/.ssh/config` (ProxyJump) or, as Ansible writes them, from `-J HOPS` or
`-o ProxyJump=HOPS` in `ansible_ssh_common_args` / `ansible_ssh_extra_args`; every hop's host key is
checked by the same rules as the target's.

Commands run as `sh -c SCRIPT` (or `sudo -n sh -c SCRIPT` with become); data, secrets included,
travels on stdin, never on a command line.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import paramiko
from fabric import Config, Connection

from ernie_deploy.errors import DeployError

log = logging.getLogger(__name__)


class HostKeyPolicy(Enum):
    STRICT = "strict"
    ACCEPT_NEW = "accept-new"


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


@dataclass(frozen=True)
class Hop:
    """One jump host, OpenSSH's `[user@]host[:port]`."""

    host: str
    port: int = 22
    user: str | None = None

    def __str__(self) -> str:
        return f"{self.user + '@' if self.user else ''}{self.host}{'' if self.port == 22 else f':{self.port}'}"


_HOP = re.compile(r"(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*)@)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])"
                  r"(?::(?P<port>[0-9]{1,5}))?")
_ARG_VARS = ("ansible_ssh_common_args", "ansible_ssh_extra_args")


def _parse_hops(spec: str, var: str, where: str) -> tuple[Hop, ...]:
    if spec.strip().lower() == "none":  # OpenSSH's way to switch off a ProxyJump set elsewhere
        return ()
    hops = []
    for part in spec.split(","):
        m = _HOP.fullmatch(part.strip())
        if not m or not 0 < int(m["port"] or 22) < 65536:
            raise DeployError(f"{var}: jump host {part.strip()!r} is not [user@]host[:port]", where=where,
                              hint="write ProxyJump=bastion.example.com or -J deploy@bastion:2222")
        hops.append(Hop(m["host"].strip("[]"), int(m["port"] or 22), m["user"]))
    return tuple(hops)


def jump_hops(host_vars: Mapping[str, Any], where: str) -> tuple[Hop, ...]:
    """Jump hosts from Ansible's SSH argument variables. Other SSH options there are not applied (this
    toolkit does not run the ssh binary), and saying so beats silently connecting differently."""
    hops: tuple[Hop, ...] = ()
    for var in _ARG_VARS:
        raw = host_vars.get(var)
        if not raw:
            continue
        try:
            words = shlex.split(str(raw))
        except ValueError as exc:
            raise DeployError(f"{var}: {exc}", where=where, hint="balance the quotes") from exc
        ignored = []
        i = 0
        while i < len(words):
            word, value = words[i], words[i + 1] if i + 1 < len(words) else ""
            option = value if word == "-o" else word[2:] if word.startswith("-o") else ""
            key, _, setting = option.replace("=", " ", 1).partition(" ")
            if word == "-J" and value:
                hops, i = _parse_hops(value, var, where), i + 2
            elif word.startswith("-J") and len(word) > 2:
                hops, i = _parse_hops(word[2:], var, where), i + 1
            elif key.lower() == "proxyjump" and setting.strip():
                hops, i = _parse_hops(setting, var, where), i + (2 if word == "-o" else 1)
            else:
                ignored.append(word)
                i += 1
        if ignored:
            log.warning("%s: %s: only -J / ProxyJump is honoured here; ignored %s (put other SSH options "
                        "in ~/.ssh/config)", where, var, " ".join(ignored))
    return hops


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
    jump: tuple[Hop, ...] = ()

    @classmethod
    def from_host(cls, name: str, address: str, port: int, user: str | None, host_vars: Mapping[str, Any],
                  extra_known_hosts: Sequence[str] = ()) -> Target:
        files = [str(host_vars["ernie_known_hosts"])] if host_vars.get("ernie_known_hosts") else []
        become = bool(host_vars.get("ansible_become", False)) or (user not in (None, "root"))
        return cls(name=name, address=address, port=port, user=user,
                   key_file=host_vars.get("ansible_ssh_private_key_file"),
                   known_hosts=tuple(files) + tuple(extra_known_hosts), become=become,
                   jump=jump_hops(host_vars, name))


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
    """Record an unknown key in the first known_hosts file; changed keys still fail (paramiko raises)."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        t = self.target
        path = Path(t.known_hosts[0] if t.known_hosts else "~/.ssh/known_hosts").expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"{_known_host_name(t.address, t.port)} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)
        log.warning("%s: accept-new recorded host key %s in %s", t.name, fingerprint(key), path)


@dataclass
class Session:
    """An open SSH connection to one host; counts the commands it runs (-v prints the count)."""

    target: Target
    connection: Connection
    commands: int = 0
    seconds: float = 0.0
    history: list[str] = field(default_factory=list)

    def run(self, script: str, *, stdin: bytes = b"", timeout: float = 120.0, check: bool = True,
            label: str | None = None) -> RunResult:
        """Run a shell script on the host (as root via `sudo -n` when the target needs become)."""
        command = f"sh -c {shlex.quote(script)}"
        if self.target.become:
            command = f"sudo -n -- {command}"
        self.commands += 1
        self.history.append(label or script.split("\n", 1)[0][:60])
        started = time.monotonic()
        try:
            chan_in, chan_out, chan_err = self.connection.client.exec_command(command, timeout=timeout)
            if stdin:
                chan_in.write(stdin)
            chan_in.channel.shutdown_write()
            out = chan_out.read()
            err = chan_err.read()
            code = chan_out.channel.recv_exit_status()
        except (TimeoutError, paramiko.SSHException, OSError) as exc:
            raise RemoteError(Failure.UNREACHABLE, f"connection lost while running {label or 'a command'}: {exc}",
                              where=self.target.name) from exc
        finally:
            self.seconds += time.monotonic() - started
        result = RunResult(label or script, code, out, err)
        if check and code != 0:
            tail = "\n".join(err.decode(errors="replace").strip().splitlines()[-5:])
            hint = "the host's sudo needs NOPASSWD for this user" if "sudo:" in tail and "password" in tail else None
            raise RemoteError(Failure.COMMAND, f"{label or 'command'} exited {code}: {tail or '(no stderr)'}",
                              where=self.target.name, hint=hint)
        return result

    def close(self) -> None:
        conn: Any = self.connection
        while isinstance(conn, Connection):  # fabric leaves jump connections open; close every hop
            conn.close()
            conn = conn.gateway

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prepare_client(client: paramiko.SSHClient, target: Target, policy: HostKeyPolicy) -> None:
    default = Path("~/.ssh/known_hosts").expanduser()
    if default.is_file():
        client.load_host_keys(str(default))
    for extra in target.known_hosts:
        path = Path(extra).expanduser()
        if path.is_file():
            client.get_host_keys().load(str(path))
    client.set_missing_host_key_policy(_AcceptNew(target) if policy is HostKeyPolicy.ACCEPT_NEW else _Strict(target))


def connect(target: Target, *, policy: HostKeyPolicy = HostKeyPolicy.STRICT, timeout: float = 10.0,
            retries: int = 2) -> Session:
    """Open a session, retrying only unreachable hosts (bounded, with backoff)."""
    attempt = 0
    while True:
        try:
            return _connect_once(target, policy, timeout)
        except RemoteError as exc:
            if exc.kind is not Failure.UNREACHABLE or attempt >= retries:
                raise
            attempt += 1
            time.sleep(min(0.5 * 2**attempt, 4.0))


def _connect_once(target: Target, policy: HostKeyPolicy, timeout: float) -> Session:
    connect_kwargs: dict[str, Any] = {"allow_agent": True, "look_for_keys": True, "banner_timeout": timeout,
                                      "auth_timeout": timeout}
    if target.key_file:
        connect_kwargs["key_filename"] = [str(Path(target.key_file).expanduser())]
    gateway: Connection | None = None
    for hop in target.jump:  # first hop first: each later hop is reached through the one before
        gateway = Connection(hop.host, user=hop.user, port=hop.port, connect_timeout=timeout,
                             connect_kwargs=connect_kwargs, config=Config(), gateway=gateway)
    conn = Connection(target.address, user=target.user, port=target.port, connect_timeout=timeout,
                      connect_kwargs=connect_kwargs, config=Config(), gateway=gateway)
    _prepare_client(conn.client, target, policy)
    hop_conn: Any = conn.gateway
    while isinstance(hop_conn, Connection):  # inventory or ~/.ssh/config hops: the same host-key rules
        _prepare_client(hop_conn.client, Target(f"{target.name} (jump host {hop_conn.host}:{hop_conn.port})",
                                                hop_conn.host, hop_conn.port, known_hosts=target.known_hosts),
                        policy)
        hop_conn = hop_conn.gateway
    where = target.name
    via = f" via {','.join(str(h) for h in target.jump)}" if target.jump else ""
    try:
        conn.open()
    except RemoteError:
        raise
    except paramiko.BadHostKeyException as exc:
        files = ", ".join(target.known_hosts) or "~/.ssh/known_hosts"
        raise RemoteError(
            Failure.HOST_KEY,
            f"host key for {target.address}:{target.port} CHANGED: offered {fingerprint(exc.key)}, "
            f"known {fingerprint(exc.expected_key)}", where=where,
            hint=(f"if {target.name} was reinstalled, verify the new key and replace the old one "
                  f"(ssh-keygen -R {_known_host_name(target.address, target.port)} -f FILE; known_hosts read: "
                  f"{files}); otherwise someone may be intercepting the connection")) from exc
    except paramiko.AuthenticationException as exc:
        raise RemoteError(Failure.AUTH, f"{target.user or 'default user'}@{target.address}{via}: {exc}", where=where,
                          hint="check ansible_user and ansible_ssh_private_key_file, or load the key into "
                               "ssh-agent") from exc
    except (TimeoutError, OSError, paramiko.SSHException, EOFError) as exc:
        raise RemoteError(Failure.UNREACHABLE,
                          f"{target.address}:{target.port}{via}: {exc or type(exc).__name__}", where=where,
                          hint="check that the host (and any jump host) is up and sshd listens there") from exc
    return Session(target, conn)
