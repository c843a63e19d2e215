"""Connections opened ahead (orchestration/ahead.py): deploy and restart start connecting to their first hosts
while they load the rest of themselves; the fleet gets those sessions, and nothing is left open or contacted
on bad input."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode
from ernie_deploy.orchestration.ahead import ConnectAhead
from ernie_deploy.remote.ssh import Failure, RemoteError, Target


class Recorded:
    """A session that knows whether it was closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self.commands = 0
        self.history: list[str] = []

    def run(self, cmd: Any) -> Any:
        raise AssertionError("not used")

    def close(self) -> None:
        self.closed = True


class Scripted:
    """A connector that records each connect; hosts in `gate` wait for it before they connect."""

    def __init__(self, fail: str = "", gate: threading.Event | None = None) -> None:
        self.calls: list[str] = []
        self.sessions: dict[str, Recorded] = {}
        self.fail, self.gate = fail, gate
        self.lock = threading.Lock()

    def __call__(self, target: Target) -> Recorded:
        with self.lock:
            self.calls.append(target.name)
        if self.gate is not None:
            self.gate.wait(5)
        if target.name == self.fail:
            raise RemoteError(Failure.UNREACHABLE, f"{target.address}:22: connection refused", where=target.name)
        session = self.sessions[target.name] = Recorded(target.name)
        return session


def targets(*names: str) -> list[Target]:
    return [Target(name, f"127.0.0.{11 + k}") for k, name in enumerate(names)]


def test_a_host_connected_ahead_gets_that_session_and_others_connect_when_asked() -> None:
    connect = Scripted()
    a, b, c = targets("a", "b", "c")
    ahead = ConnectAhead(connect, [a, b, c], forks=2)
    assert ahead(a) is connect.sessions["a"] and ahead(b) is connect.sessions["b"]
    assert sorted(connect.calls) == ["a", "b"]  # c was beyond --forks: not connected ahead
    assert ahead(c) is connect.sessions["c"] and connect.calls.count("c") == 1
    assert ahead(a) is not connect.sessions["b"] and connect.calls.count("a") == 2  # claimed once; then anew
    ahead.close()
    assert not any(s.closed for s in connect.sessions.values())


def test_the_error_of_an_ahead_connect_is_raised_to_whoever_claims_the_host() -> None:
    connect = Scripted(fail="b")
    a, b = targets("a", "b")
    ahead = ConnectAhead(connect, [a, b], forks=5)
    with pytest.raises(RemoteError, match="connection refused") as err:
        ahead(b)
    assert err.value.kind is Failure.UNREACHABLE and connect.calls.count("b") == 1
    ahead.close()


def test_close_closes_what_nobody_claimed_also_when_it_connects_after_close() -> None:
    gate = threading.Event()
    connect = Scripted(gate=gate)
    a, b = targets("a", "b")
    ahead = ConnectAhead(connect, [a, b], forks=5)
    ahead.close()  # both still connecting
    gate.set()
    deadline = threading.Event()
    for _ in range(100):
        if len(connect.sessions) == 2 and all(s.closed for s in connect.sessions.values()):
            break
        deadline.wait(0.02)
    assert sorted(connect.sessions) == ["a", "b"] and all(s.closed for s in connect.sessions.values())


def inventory(tmp_path: Path, names: list[str]) -> Path:
    hosts = {n: {"ansible_host": f"127.0.0.{11 + k}"} for k, n in enumerate(names)}
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "vllm_stable_seconds": 0}, "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_deploy_and_restart_use_each_hosts_one_session_and_close_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fakes = {"a": FakeHost(), "b": FakeHost(), "c": FakeHost()}
    opened: list[str] = []
    closed: list[str] = []
    inner = connector(fakes)

    def connect(target: Target) -> Any:
        session = inner(target)
        opened.append(target.name)
        session.close = lambda: closed.append(target.name)
        return session

    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connect)
    path = inventory(tmp_path, ["a", "b", "c"])
    assert main(["deploy", "-i", str(path), "--forks", "2", "--json"]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert [(h["host"], h["status"]) for h in doc["hosts"]] == [("a", "changed"), ("b", "changed"),
                                                                 ("c", "changed")]
    assert sorted(opened) == sorted(closed) == ["a", "b", "c"]  # one connection per host, none spare, all closed
    opened.clear()
    closed.clear()
    assert main(["restart", "-i", str(path), "--forks", "2", "--json"]) == ExitCode.OK
    assert sorted(opened) == sorted(closed) == ["a", "b", "c"]


@pytest.mark.parametrize("bad", [["--canary", "-1"], ["--serial", "0"], ["--timeline", "out.png"],
                                 ["--max-fail-percentage", "x"]])
@pytest.mark.parametrize("command", ["deploy", "restart"])
def test_bad_rollout_options_contact_no_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str], command: str, bad: list[str]) -> None:
    connect = Scripted()
    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connect)
    assert main([command, "-i", str(inventory(tmp_path, ["a", "b"])), *bad]) == ExitCode.INPUT
    assert "error:" in capsys.readouterr().err and connect.calls == []
