"""The SSH session's run: what it reads and how it waits, against a fake channel; and against a real SSH
server in this process, reached through a relay that can freeze like a host that stops answering (kill -STOP:
the connection stays open, nothing comes back)."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import paramiko
import pytest

from ernie_deploy.cli.remote import connector, ssh_options
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions, HostRun
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.remote import ssh
from ernie_deploy.remote.command import script
from ernie_deploy.remote.ssh import Failure, Liveness, RemoteError, Session, Target, connect


class _Window:
    """A channel whose stdout only ends once its stderr was read, as a real one whose window is full of stderr
    (paramiko #1778): reading stdout first, then stderr, would wait forever."""

    def __init__(self) -> None:
        self.stderr_read = threading.Event()
        self.channel = SimpleNamespace(shutdown_write=lambda: None, recv_exit_status=lambda: 0)
        self.written: list[bytes] = []

    def get_transport(self) -> None:
        return None

    def exec_command(self, command: str, timeout: float | None = None) -> tuple[Any, Any, Any]:
        window = self

        class Stdin:
            channel = window.channel

            def write(self, data: bytes) -> None:
                window.written.append(data)

        class Stdout:
            channel = window.channel

            def read(self) -> bytes:
                if not window.stderr_read.wait(5):
                    raise TimeoutError("stdout never ended: stderr was not read")
                return b"out\n"

        class Stderr:
            def read(self) -> bytes:
                window.stderr_read.set()
                return b"e" * 300_000

        return Stdin(), Stdout(), Stderr()


def test_stdout_and_stderr_are_read_together() -> None:
    window = _Window()
    session = Session(Target("h1", "10.0.0.1"), SimpleNamespace(client=window))  # type: ignore[arg-type]
    result = session.run(script("echo out; big >&2", stdin=b"in"))
    assert (result.code, result.stdout, len(result.stderr)) == (0, b"out\n", 300_000)
    assert window.written == [b"in"]


class _Server(paramiko.ServerInterface):
    """Accepts any key; `echo` answers at once, `sleep` stays quiet for 2.5 s before it exits 0."""

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        def answer() -> None:
            while channel.recv(1024):  # the client ends its input only once the exec request was answered
                pass
            if b"sleep" in command:
                time.sleep(2.5)
            channel.sendall(b"hi\n")
            channel.send_exit_status(0)
            channel.close()

        threading.Thread(target=answer, daemon=True).start()
        return True


@dataclass
class _Host:
    """An SSH server behind a TCP relay; `freeze()` stops the relay passing bytes either way."""

    target: Target
    frozen: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def _serve(listener: socket.socket, key: paramiko.PKey) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        transport = paramiko.Transport(conn)
        transport.add_server_key(key)
        transport.start_server(server=_Server())


def _relay(listener: socket.socket, server_port: int, host: _Host) -> None:
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while host.frozen.is_set() and not host.stop.is_set():
                    host.stop.wait(0.05)
                dst.sendall(data)
        except OSError:
            pass

    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        server = socket.create_connection(("127.0.0.1", server_port))
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=pump, args=(src, dst), daemon=True).start()


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Host]:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh of the machine running this
    host_key, user_key = paramiko.RSAKey.generate(1024), paramiko.RSAKey.generate(1024)
    user_key.write_private_key_file(str(tmp_path / "id_rsa"))
    server, relay = _listener(), _listener()
    port = relay.getsockname()[1]
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{port} ssh-rsa {host_key.get_base64()}\n")
    h = _Host(Target("gpu-01", "127.0.0.1", port, user="root", key_file=str(tmp_path / "id_rsa"),
                     known_hosts=(str(tmp_path / "known_hosts"),)))
    threading.Thread(target=_serve, args=(server, host_key), daemon=True).start()
    threading.Thread(target=_relay, args=(relay, server.getsockname()[1], h), daemon=True).start()
    yield h
    h.stop.set()
    server.close()
    relay.close()


def test_a_host_that_stops_answering_is_unreachable_within_the_host_timeout(host: _Host) -> None:
    session = connect(host.target, timeout=5, host_timeout=1.0)
    heard: list[tuple[float, float]] = []
    session.on_silence = lambda quiet, limit: heard.append((quiet, limit))
    assert session.run(script("echo hi")).text == "hi\n"
    host.frozen.set()
    started = time.monotonic()
    with pytest.raises(RemoteError) as raised:
        session.run(script("sleep 2; echo hi", timeout=30))  # before: waited the command's 30 s
    assert time.monotonic() - started < 3
    assert raised.value.kind is Failure.UNREACHABLE and raised.value.where == "gpu-01"
    assert "answered nothing for 1s" in raised.value.message and "--host-timeout" in (raised.value.hint or "")
    assert heard and all(limit == 1.0 and quiet < 1.0 for quiet, limit in heard)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="script not sent: the host answered nothing"):
        session.run(script("release lock"))  # the close phase's release: refused at once, not waited for
    session.close()
    assert time.monotonic() - started < 1


def test_a_command_that_is_quiet_on_a_live_host_is_not_given_up(host: _Host) -> None:
    session = connect(host.target, timeout=5, host_timeout=1.0)
    try:
        assert session.run(script("sleep 2.5")).code == 0  # 2.5 s without output: the host still answers
    finally:
        session.close()


def test_a_host_quiet_for_less_than_the_host_timeout_is_waited_for_and_said_to_answer_again(host: _Host) -> None:
    session = connect(host.target, timeout=5, host_timeout=3.0)
    heard: list[float] = []
    session.on_silence = lambda quiet, limit: heard.append(quiet)
    threading.Timer(0.3, host.frozen.set).start()
    threading.Timer(2.0, host.frozen.clear).start()
    try:
        assert session.run(script("sleep 2.5")).text == "hi\n"
    finally:
        session.close()
    assert heard[-1] == 0.0 and max(heard) > 0  # "no answer for 1s", then "answers again"


def test_the_host_timeout_is_set_on_the_command_line_and_silence_shows_as_progress(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    ssh_options(parser)
    made: list[Session] = []

    def connect_fake(target: Target, **kwargs: Any) -> Session:
        session = Session(target, SimpleNamespace(client=_Window()),  # type: ignore[arg-type]
                          liveness=Liveness(kwargs["host_timeout"]))
        made.append(session)
        return session

    monkeypatch.setattr(ssh, "connect", connect_fake)
    seen: list[tuple[str, str]] = []
    fleet = Fleet(connector(parser.parse_args(["--host-timeout", "45"])), FleetOptions(),
                  lambda host, what: seen.append((host, what)))
    host = SimpleNamespace(name="a10-2", address="10.0.0.2", port=22, user=None, vars={})
    fleet.connect(HostRun(host, HostResult("a10-2")))  # type: ignore[arg-type]
    assert made[0].liveness.limit == 45
    assert made[0].on_silence is not None
    made[0].on_silence(30.4, 45.0)
    assert seen[-1] == ("a10-2", "no answer for 30s (gives up at 45s, --host-timeout)")
    made[0].on_silence(0.0, 45.0)
    assert seen[-1] == ("a10-2", "answers again")
    with pytest.raises(SystemExit):
        parser.parse_args(["--host-timeout", "0"])
