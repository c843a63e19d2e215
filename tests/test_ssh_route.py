"""Routes to hosts written the way Ansible inventories write them, and the SSH connection chain built
from them (no network: the chain is inspected, and opening it is made to fail)."""

from __future__ import annotations

import logging
from pathlib import Path

import paramiko
import pytest
from fabric import Connection

from ernie_deploy.errors import DeployError
from ernie_deploy.remote import ssh
from ernie_deploy.remote.route import Hop, Route, route_from_vars
from ernie_deploy.remote.ssh import Failure, HostKeyPolicy, RemoteError, Target


@pytest.mark.parametrize(("args", "route"), [
    ("-o ProxyJump=bastion", Route(hops=(Hop("bastion"),))),
    ("-o ProxyJump=ops@bastion.dc1:2222", Route(hops=(Hop("bastion.dc1", 2222, "ops"),))),
    ("-oProxyJump=bastion", Route(hops=(Hop("bastion"),))),
    ("-o 'ProxyJump bastion'", Route(hops=(Hop("bastion"),))),
    ("-J a@jump1,jump2:2200", Route(hops=(Hop("jump1", 22, "a"), Hop("jump2", 2200)))),
    ("-Jjump1", Route(hops=(Hop("jump1"),))),
    ("-o proxyjump=[fd00::1]:2222", Route(hops=(Hop("fd00::1", 2222),))),
    ("-o ProxyJump=none", Route(direct=True)),
    ("-o 'ProxyCommand=ssh -W %h:%p -q ops@bastion'", Route(command="ssh -W %h:%p -q ops@bastion")),
    ("-o ProxyCommand=none", Route(direct=True)),
    ("", Route()),
])
def test_route_from_ansible_ssh_args(args: str, route: Route) -> None:
    assert route_from_vars({"ansible_ssh_common_args": args}, "gpu-01") == route


def test_first_route_wins_as_in_openssh(caplog: pytest.LogCaptureFixture) -> None:
    """Ansible passes the common args before the extra args; ssh keeps the first ProxyJump it sees."""
    with caplog.at_level(logging.WARNING):
        route = route_from_vars({"ansible_ssh_common_args": "-J first",
                                 "ansible_ssh_extra_args": "-o ProxyJump=second"}, "gpu-01")
    assert route == Route(hops=(Hop("first"),))
    assert "ProxyJump=second" in caplog.text


def test_other_ssh_options_are_named_once_as_ignored(caplog: pytest.LogCaptureFixture) -> None:
    args = {"ansible_ssh_common_args": "-o UserKnownHostsFile=/dev/null.test -J bastion"}
    with caplog.at_level(logging.WARNING):
        assert route_from_vars(args, "gpu-01") == Route(hops=(Hop("bastion"),))
        route_from_vars(args, "gpu-02")  # the same group-wide value on the next host: no second warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "gpu-01" in warnings[0] and "UserKnownHostsFile=/dev/null.test" in warnings[0]


@pytest.mark.parametrize(("args", "message"), [
    ("-J 'bad host'", "'bad host' is not [user@]host[:port]"),
    ("-J bastion:99999", "'bastion:99999' is not [user@]host[:port]"),
    ("-J a,,b", "'' is not [user@]host[:port]"),
    ("-o 'ProxyJump=bastion", "No closing quotation"),
])
def test_bad_routes_name_the_host_and_variable(args: str, message: str) -> None:
    with pytest.raises(DeployError) as err:
        route_from_vars({"ansible_ssh_common_args": args}, "gpu-01")
    assert message in err.value.message and "ansible_ssh_common_args" in err.value.message
    assert err.value.where == "gpu-01"


def chain(route_args: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Connection]:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/config or known_hosts of the machine running this
    target = Target.from_host("gpu-01", "10.0.0.5", 22, "root", {"ansible_ssh_common_args": route_args})
    conns, conn = [], ssh._chain(target, HostKeyPolicy.STRICT, 5.0)
    while isinstance(conn, Connection):
        conns.append(conn)
        conn = conn.gateway
    return conns


def test_hops_are_chained_first_hop_first_and_all_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conns = chain("-J ops@b1,b2:2200", tmp_path, monkeypatch)
    assert [(c.host, c.port) for c in conns] == [("10.0.0.5", 22), ("b2", 2200), ("b1", 22)]
    assert conns[-1].user == "ops" and conns[-1].gateway is None  # b1 is connected first
    assert all(isinstance(c.client._policy, ssh._Strict) for c in conns)
    assert len({id(c.connect_kwargs) for c in conns}) == 3  # fabric edits them in place: never shared


def test_direct_and_proxy_command_routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (direct,) = chain("-o ProxyJump=none", tmp_path, monkeypatch)
    assert direct.gateway is False  # overrides a ProxyJump that ~/.ssh/config might set
    (proxied,) = chain("-o 'ProxyCommand=ssh -W %h:%p bastion'", tmp_path, monkeypatch)
    assert proxied.gateway == "ssh -W %h:%p bastion"


def test_failed_open_closes_every_hop_and_is_classified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    closed: list[int] = []

    def refuse(self: Connection) -> None:
        raise paramiko.AuthenticationException("Authentication failed.")

    monkeypatch.setattr(Connection, "open", refuse)
    monkeypatch.setattr(paramiko.SSHClient, "close", lambda self: closed.append(id(self)))
    target = Target.from_host("gpu-01", "10.0.0.5", 22, "root", {"ansible_ssh_common_args": "-J b1,b2"})
    with pytest.raises(RemoteError) as err:
        ssh._connect_once(target, HostKeyPolicy.STRICT, 5.0)
    assert err.value.kind is Failure.AUTH and "root@10.0.0.5 via b1,b2" in err.value.message
    assert len(set(closed)) == 3


def test_changed_jump_host_key_names_the_jump_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    got, known = paramiko.RSAKey.generate(1024), paramiko.RSAKey.generate(1024)

    def changed(self: Connection) -> None:
        raise paramiko.BadHostKeyException("[b1]:2222", got, known)

    monkeypatch.setattr(Connection, "open", changed)
    target = Target.from_host("gpu-01", "10.0.0.5", 22, "root", {"ansible_ssh_common_args": "-J b1:2222"})
    with pytest.raises(RemoteError) as err:
        ssh._connect_once(target, HostKeyPolicy.STRICT, 5.0)
    assert err.value.kind is Failure.HOST_KEY
    assert "host key for jump host [b1]:2222 CHANGED" in err.value.message
    assert "ssh-keygen -R [b1]:2222" in (err.value.hint or "") and "10.0.0.5" not in (err.value.hint or "")


def test_connection_failures_say_why() -> None:
    """Not `[Errno None] Unable to connect`: refused, timed out, no route, name not resolved."""
    import errno
    import socket

    from paramiko.ssh_exception import NoValidConnectionsError

    from ernie_deploy.remote.ssh import connection_reason

    refused = NoValidConnectionsError({("127.0.0.1", 22): OSError(errno.ECONNREFUSED, "Connection refused")})
    assert connection_reason(refused) == "connection refused (nothing listens on that port)"
    assert connection_reason(OSError(errno.EHOSTUNREACH, "x")) == "no route to host"
    assert connection_reason(TimeoutError()) == "connection timed out"
    assert connection_reason(socket.gaierror(-2, "Name or service not known")).startswith("host name not resolved")
