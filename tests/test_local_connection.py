"""`ansible_connection: local`: the inventory's connection values, the local transport running real shell
commands on this machine (stdin, streams, exit codes, timeouts, environment, sudo), the connector's choice,
and the balancer rule for a local host. The deploy → verify → restart over a local connection with real
systemd runs inside a lab host: tests/lab/test_lab_local.py."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.cli.remote import connector, ssh_options
from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.connection import (
    ConnectionType,
    check_connections,
    check_fronted,
    connection_of,
    is_loopback,
)
from ernie_deploy.inventory.inventory import Host
from ernie_deploy.remote import local, ssh
from ernie_deploy.remote.command import Command, Script, script
from ernie_deploy.remote.local import LOGIN_PATH, LocalSession
from ernie_deploy.remote.ssh import Failure, RemoteError, Target

LOCAL = Target("box", "localhost", connection=ConnectionType.LOCAL)


def host(name: str, **variables: Any) -> Host:
    return Host(name, MappingProxyType(variables))


# -- the inventory's values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["ssh", "ansible.builtin.ssh", "paramiko", "paramiko_ssh",
                                   "ansible.builtin.paramiko_ssh", "smart"])
def test_ansible_spellings_of_ssh_mean_ssh(value: str) -> None:
    assert connection_of("gpu1", {"ansible_connection": value}) is ConnectionType.SSH


def test_no_connection_variable_means_ssh_and_local_means_this_machine() -> None:
    assert connection_of("gpu1", {}) is ConnectionType.SSH
    assert connection_of("gpu1", {"ansible_connection": "local"}) is ConnectionType.LOCAL
    assert connection_of("gpu1", {"ansible_connection": "ansible.builtin.local"}) is ConnectionType.LOCAL


@pytest.mark.parametrize("value", ["winrm", "psrp", "community.docker.docker", "docker", "LOCAL", "", 5, None])
def test_other_connections_are_refused_naming_host_value_and_fix(value: object) -> None:
    with pytest.raises(InventoryError) as caught:
        connection_of("gpu1", {"ansible_connection": value})
    err = caught.value
    assert err.where == "gpu1"
    assert repr(value) in err.message
    assert err.hint is not None and "ssh" in err.hint and "local" in err.hint


def test_a_local_target_carries_no_ssh_settings() -> None:
    t = Target.from_host("box", "localhost", 22, "deploy", {
        "ansible_connection": "local", "ansible_become": True, "ernie_known_hosts": "kh",
        "ansible_ssh_private_key_file": "~/.ssh/id", "ansible_ssh_common_args": "-J jump"}, ["extra_kh"])
    assert t.connection is ConnectionType.LOCAL
    assert (t.user, t.key_file, t.known_hosts, t.become, t.route.hops) == (None, None, (), False, ())
    assert Target.from_host("gpu1", "10.0.0.1", 22, "deploy", {"ansible_connection": "paramiko"}).become


def test_one_local_host_per_role() -> None:
    check_connections([host("a", ansible_connection="local"), host("b")], "vLLM hosts")
    with pytest.raises(InventoryError, match="a, b all use ansible_connection: local") as caught:
        check_connections([host("a", ansible_connection="local"), host("b", ansible_connection="local")],
                          "vLLM hosts")
    assert caught.value.where == "b"
    with pytest.raises(InventoryError, match="'winrm'"):
        check_connections([host("a"), host("w", ansible_connection="winrm")], "vLLM hosts")


@pytest.mark.parametrize("address", ["localhost", "LOCALHOST.", "127.0.0.1", "127.0.0.53", "::1"])
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["10.0.0.5", "gpu1", "::", "0.0.0.0", "localhost.example.com"])
def test_not_loopback(address: str) -> None:
    assert not is_loopback(address)


def test_a_local_host_at_loopback_is_refused_behind_a_balancer_elsewhere() -> None:
    box = host("box", ansible_connection="local", ansible_host="localhost")
    lb = host("lb", ansible_host="10.0.0.9")
    with pytest.raises(InventoryError) as caught:
        check_fronted(lb, "10.0.0.9", box, "box-0", "localhost")
    assert caught.value.where == "box"
    assert "balancer lb (10.0.0.9) cannot reach" in caught.value.message
    assert caught.value.hint is not None and "ansible_host of box" in caught.value.hint


def test_a_local_host_is_fine_behind_a_balancer_here_or_at_its_lan_address() -> None:
    box = host("box", ansible_connection="local", ansible_host="localhost")
    check_fronted(host("lb", ansible_connection="local"), "localhost", box, "box-0", "localhost")
    check_fronted(host("lb", ansible_host="127.0.0.1"), "127.0.0.1", box, "box-0", "127.0.0.1")
    check_fronted(host("lb", ansible_host="10.0.0.9"), "10.0.0.9", box, "box-0", "10.0.0.5")
    check_fronted(host("lb", ansible_host="10.0.0.9"), "10.0.0.9", host("gpu1", ansible_host="127.0.0.1"),
                  "gpu1-0", "127.0.0.1")  # an SSH host's loopback is the planner's rule (planning/balancer.py)


# -- the local transport on this machine ------------------------------------------------------------------------


def test_runs_the_script_with_its_stdin_and_stream_and_counts_it() -> None:
    session = LocalSession(LOCAL)
    cmd = script("cat; echo err >&2", stdin=b"secret-on-stdin\n")
    streamed = Command(Script("wc -c"), stdin=b"ab", stream=iter([b"cd", b"ef"]))
    result = session.run(cmd)
    assert (result.code, result.stdout, result.stderr) == (0, b"secret-on-stdin\n", b"err\n")
    assert session.run(streamed).text.strip() == "6"
    assert (session.commands, session.history) == (2, ["script", "script"])


def test_large_output_on_both_streams_does_not_block() -> None:
    result = LocalSession(LOCAL).run(script("head -c 3000000 /dev/zero; head -c 3000000 /dev/zero >&2",
                                            timeout=20))
    assert (len(result.stdout), len(result.stderr)) == (3000000, 3000000)


def test_exit_codes_raise_when_checked_with_the_end_of_stderr() -> None:
    session = LocalSession(LOCAL)
    assert session.run(script("exit 3", check=False)).code == 3
    with pytest.raises(RemoteError) as caught:
        session.run(script("echo first >&2; echo last words >&2; exit 7"))
    assert caught.value.kind is Failure.COMMAND and caught.value.where == "box"
    assert "script exited 7: first\nlast words" in caught.value.message


def test_a_command_past_its_timeout_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"ran past its timeout of 0\.5s") as caught:
        LocalSession(LOCAL).run(script(f"sleep 30 & echo $! > {marker}; wait", timeout=0.5))
    assert time.monotonic() - started < 5
    assert caught.value.kind is Failure.COMMAND
    stat = Path(f"/proc/{int(marker.read_text())}/stat")
    deadline = time.monotonic() + 5
    while not _ended(stat) and time.monotonic() < deadline:  # its reaper (PID 1) may take a moment
        time.sleep(0.05)
    assert _ended(stat)


def _ended(stat: Path) -> bool:
    """Gone, or a zombie waiting for PID 1 to reap it: either way it runs no more."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_script_gets_a_login_environment_not_the_controllers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERNIE_TEST_SECRET", "do-not-pass")
    monkeypatch.setenv("PATH", "/somewhere/venv/bin:" + os.environ["PATH"])
    out = LocalSession(LOCAL).run(script('echo "${ERNIE_TEST_SECRET-unset}|$PATH|$PWD"')).text.strip()
    assert out == f"unset|{LOGIN_PATH}|{local.login_env()['HOME']}"


def test_a_user_without_a_home_starts_in_the_root_directory() -> None:
    session = LocalSession(LOCAL, env={"PATH": LOGIN_PATH, "HOME": "/nonexistent/home"})
    assert session.run(script("pwd")).text == "/\n"


def test_the_script_is_one_argument_never_parsed_again() -> None:
    text = "printf '%s' \"$1\" '; rm -rf /' `id`"
    assert LocalSession(LOCAL).argv(script(text)) == ["/bin/sh", "-c", text]
    assert LocalSession(LOCAL, sudo=True).argv(script(text)) == ["sudo", "-n", "--", "/bin/sh", "-c", text]


def test_as_root_no_sudo_otherwise_sudo_n(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert not local.connect(LOCAL).sudo
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: "/usr/bin/sudo")
    assert local.connect(LOCAL).sudo


def test_not_root_and_no_sudo_is_refused_at_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    with pytest.raises(RemoteError, match="does not run as root and sudo is not installed") as caught:
        local.connect(LOCAL)
    assert caught.value.hint is not None and "NOPASSWD" in caught.value.hint


def test_a_missing_sudo_at_run_time_says_so() -> None:
    session = LocalSession(LOCAL, sudo=True, env={"PATH": "/nonexistent", "HOME": "/"})
    with pytest.raises(RemoteError, match="not started: sudo not found"):
        session.run(script("true"))


def test_an_ssh_target_is_not_run_locally() -> None:
    with pytest.raises(ValueError, match="over SSH"):
        local.connect(Target("gpu1", "10.0.0.1"))


# -- the connector and the commands ----------------------------------------------------------------------------


def _args(**extra: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ssh_options(p)
    return p.parse_args([], namespace=argparse.Namespace(**extra))


def test_the_connector_runs_a_local_target_here_and_never_opens_ssh(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ssh(*args: object, **kwargs: object) -> None:
        raise AssertionError("SSH opened for a local host")

    monkeypatch.setattr(ssh, "connect", no_ssh)
    session = connector(_args())(LOCAL)
    assert isinstance(session, LocalSession)
    assert session.run(script("echo here")).text == "here\n"


def _inventory(tmp_path: Path, **hosts: dict[str, Any]) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    return path


@pytest.mark.parametrize("command", ["verify", "facts", "deploy", "restart", "releases"])
def test_a_bad_connection_value_stops_the_command_before_any_host_is_contacted(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    contacted: list[str] = []
    monkeypatch.setattr(ssh, "connect", lambda target, **kw: contacted.append(target.name))
    monkeypatch.setattr(local, "connect", lambda target: contacted.append(target.name))
    inv = _inventory(tmp_path, good={"ansible_host": "10.0.0.1"}, box={"ansible_connection": "community.docker.docker"})
    assert main([command, "-i", str(inv)]) == 5
    err = capsys.readouterr().err
    assert "box" in err and "'community.docker.docker' is not supported" in err and "fix:" in err
    assert contacted == []


def test_two_local_vllm_hosts_stop_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(local, "connect", lambda target: pytest.fail("contacted"))
    inv = _inventory(tmp_path, a={"ansible_connection": "local"}, b={"ansible_connection": "local"})
    assert main(["verify", "-i", str(inv)]) == 5
    assert "same machine" in capsys.readouterr().err
