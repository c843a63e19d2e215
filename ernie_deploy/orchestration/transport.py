"""What orchestration needs of a host connection: run a typed command, count, close.

The SSH session (remote/ssh.py) is the production transport, and remote/local.py's session the one for a
host with `ansible_connection: local` (this machine, no SSH); tests use a scripted fake that answers by the
command's operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ernie_deploy.planning.plan import HostLike
from ernie_deploy.remote.command import Command
from ernie_deploy.remote.ssh import RunResult, Target


class Transport(Protocol):
    commands: int
    history: list[str]

    def run(self, cmd: Command) -> RunResult: ...

    def close(self) -> None: ...


class RemoteHost(HostLike, Protocol):
    """An inventory host with what SSH needs besides its address."""

    @property
    def port(self) -> int: ...
    @property
    def user(self) -> str | None: ...


Connector = Callable[[Target], Transport]
Progress = Callable[[str, str], None]  # (host, what it is doing now)


def target_for(host: RemoteHost, known_hosts: Sequence[str]) -> Target:
    return Target.from_host(host.name, host.address, host.port, host.user, host.vars, known_hosts)
