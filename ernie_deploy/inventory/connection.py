"""How ernie-deploy reaches an inventory host: Ansible's `ansible_connection`, reduced to the two it supports.

Ansible's own spellings are kept, so one inventory serves both tools (ansible-core 2.19's connection plugins,
https://docs.ansible.com/ansible/latest/plugins/connection.html): `ssh` (ansible.builtin.ssh, the default),
`paramiko` (ansible.builtin.paramiko_ssh: SSH through the Python library ernie-deploy itself uses) and `smart`
(the deprecated default that picks ssh or paramiko: ansible-core's config/base.yml DEFAULT_TRANSPORT) all mean
SSH here; `local` (ansible.builtin.local) means the machine ernie-deploy runs on, with no SSH at all. Every
other plugin (winrm, psrp, community.docker.docker, ...) is refused before any host is contacted: the
commands ernie-deploy runs need a POSIX shell, systemd and python3 on a host it reaches one of those two ways.

A local host is the controller itself: two local vLLM hosts in one run would be the same machine planned
twice (its units, releases and deploy lock), and a balancer on another machine cannot reach an instance
whose address is this machine's loopback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, Protocol

from ernie_deploy.errors import InventoryError

VARIABLE = "ansible_connection"


class ConnectionType(Enum):
    SSH = "ssh"
    LOCAL = "local"


_SSH = ("ssh", "ansible.builtin.ssh", "paramiko", "paramiko_ssh", "ansible.builtin.paramiko_ssh", "smart")
SPELLINGS: Mapping[str, ConnectionType] = {**{name: ConnectionType.SSH for name in _SSH},
                                           "local": ConnectionType.LOCAL, "ansible.builtin.local": ConnectionType.LOCAL}
# Names that always mean this machine (RFC 6761 section 6.3 reserves `localhost`); addresses are judged as IPs.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class InventoryHost(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def vars(self) -> Mapping[str, Any]: ...


def connection_of(name: str, host_vars: Mapping[str, Any]) -> ConnectionType:
    """The host's connection; an unsupported `ansible_connection` raises InventoryError naming host, value, fix."""
    value = host_vars.get(VARIABLE, "ssh")
    found = SPELLINGS.get(value) if isinstance(value, str) else None
    if found is None:
        raise InventoryError(
            f"ansible_connection {value!r} is not supported: ernie-deploy reaches a host over SSH or runs on the "
            "machine it is started on (local)", where=name,
            hint="set ansible_connection to ssh (the default; paramiko and smart mean SSH too) or to local for the "
                 "machine you run ernie-deploy on; a host behind another connection (winrm, a container) needs "
                 "sshd, systemd and python3 reachable over SSH")
    return found


def is_local(host: InventoryHost) -> bool:
    return connection_of(host.name, host.vars) is ConnectionType.LOCAL


def is_loopback(address: str) -> bool:
    """Whether an address (IP or name) is this machine's own: `localhost`, 127.0.0.0/8, ::1."""
    if address.lower().rstrip(".") in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_connections(hosts: Iterable[InventoryHost], role: str) -> None:
    """Every host's `ansible_connection` (raises on the first bad one), and at most one local host: two would
    be this machine twice. `role` names what the hosts are (vLLM hosts, balancer hosts) in the message."""
    local = [h.name for h in hosts if is_local(h)]
    if len(local) > 1:
        raise InventoryError(
            f"{role} {', '.join(local)} all use ansible_connection: local, so they are the same machine (the one "
            "ernie-deploy runs on) planned more than once", where=local[1],
            hint="keep ansible_connection: local on one host; reach the others over SSH (remove the variable)")


def check_fronted(balancer: InventoryHost, balancer_address: str, vllm: InventoryHost, server: str,
                  server_address: str) -> None:
    """A local vLLM host's instance placed at a loopback address is reachable only by a balancer on this same
    machine (itself local, or reached at a loopback address); any other balancer would see it DOWN forever."""
    if not is_local(vllm) or not is_loopback(server_address):
        return
    if is_local(balancer) or is_loopback(balancer_address):
        return
    raise InventoryError(
        f"instance {server} is at {server_address}, this machine's loopback (ansible_connection: local), which "
        f"balancer {balancer.name} ({balancer_address}) cannot reach", where=vllm.name,
        hint=f"set ansible_host of {vllm.name} to an address {balancer.name} reaches it on (its LAN address): "
             "ansible_connection: local still runs every command here, without SSH")
