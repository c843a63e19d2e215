"""How to reach a host, as Ansible inventories say it: `ansible_ssh_common_args` / `ansible_ssh_extra_args`
with `-J HOPS`, `-o ProxyJump=HOPS` or `-o ProxyCommand=CMD`.

This toolkit talks SSH through paramiko, not the ssh binary, so only the route is taken from those
variables; any other option there is named in a warning instead of being silently dropped. As in OpenSSH,
the first ProxyJump/ProxyCommand given wins (Ansible passes the common args before the extra args), and
`none` means "connect directly" even where ~/.ssh/config names a jump host.
"""

from __future__ import annotations

import logging
import re
import shlex
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ernie_deploy.errors import DeployError

log = logging.getLogger(__name__)

ARG_VARS = ("ansible_ssh_common_args", "ansible_ssh_extra_args")
_HOP = re.compile(r"(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*)@)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])"
                  r"(?::(?P<port>[0-9]{1,5}))?")
# One warning per distinct ignored text: a group-wide option would otherwise repeat for every host.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


@dataclass(frozen=True)
class Hop:
    """One jump host, OpenSSH's `[user@]host[:port]`."""

    host: str
    port: int = 22
    user: str | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user + '@' if self.user else ''}{host}{'' if self.port == 22 else f':{self.port}'}"


@dataclass(frozen=True)
class Route:
    """The inventory's route to a host. The default (nothing given) leaves it to ~/.ssh/config."""

    hops: tuple[Hop, ...] = ()
    command: str | None = None
    direct: bool = False  # `ProxyJump none` / `ProxyCommand none`

    @property
    def given(self) -> bool:
        return bool(self.hops or self.command or self.direct)

    def describe(self) -> str:
        if self.hops:
            return f" via {','.join(str(h) for h in self.hops)}"
        return " via ProxyCommand" if self.command else ""


def _hops(spec: str, var: str, where: str) -> Route:
    if spec.strip().lower() == "none":
        return Route(direct=True)
    hops = []
    for part in spec.split(","):
        m = _HOP.fullmatch(part.strip())
        if not m or not 0 < int(m["port"] or 22) < 65536:
            raise DeployError(f"{var}: jump host {part.strip()!r} is not [user@]host[:port]", where=where,
                              hint="write ProxyJump=bastion.example.com or -J deploy@bastion:2222")
        hops.append(Hop(m["host"].strip("[]"), int(m["port"] or 22), m["user"]))
    return Route(hops=tuple(hops))


def _command(spec: str) -> Route:
    spec = spec.strip()
    return Route(direct=True) if spec.lower() == "none" else Route(command=spec)


def route_from_vars(host_vars: Mapping[str, Any], where: str) -> Route:
    route = Route()
    for var in ARG_VARS:
        raw = host_vars.get(var)
        if not raw:
            continue
        try:
            words = shlex.split(str(raw))
        except ValueError as exc:
            raise DeployError(f"{var}: {exc}", where=where, hint="balance the quotes") from exc
        ignored: list[str] = []
        i = 0
        while i < len(words):
            word, value = words[i], words[i + 1] if i + 1 < len(words) else ""
            option = value if word == "-o" else word[2:] if word.startswith("-o") else ""
            key, _, setting = option.replace("=", " ", 1).partition(" ")
            found, used = None, 1
            if word == "-J" and value:
                found, used = _hops(value, var, where), 2
            elif word.startswith("-J") and len(word) > 2:
                found = _hops(word[2:], var, where)
            elif key.lower() in ("proxyjump", "proxycommand") and setting.strip():
                used = 2 if word == "-o" else 1
                found = _hops(setting, var, where) if key.lower() == "proxyjump" else _command(setting)
            if found is None:
                ignored.append(word)
            elif route.given:
                ignored.extend(words[i:i + used])  # OpenSSH keeps the first route it is given
            else:
                route = found
            i += used
        if ignored:
            _warn(where, var, " ".join(ignored))
    return route


def _warn(where: str, var: str, ignored: str) -> None:
    with _warned_lock:
        if (var, ignored) in _warned:
            return
        _warned.add((var, ignored))
    log.warning("%s: %s: only the route (-J, ProxyJump, ProxyCommand) is used; ignored %s (put other SSH "
                "options in ~/.ssh/config)", where, var, ignored)
