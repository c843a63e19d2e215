"""A host that cannot be reached is told one way by every command (issue 38): `HOST: unreachable: WHY` and its
fix (deploy-style lines lead with the status and say the rest once), never `HOST: HOST:` or the kind twice.
The host is a closed port on loopback: the connection is refused at once."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode

WHY = "127.0.0.250:2: connection refused (nothing listens on that port)"


@pytest.mark.parametrize(("argv", "line"), [
    (["deploy"], f"unreachable: h1 ({{}}s) {WHY}"),
    (["verify"], f"unreachable: h1 ({{}}s) {WHY}"),
    (["status"], f"h1: unreachable: {WHY}"),
    (["provision"], f"h1: unreachable: {WHY}"),
    (["facts"], f"h1: unreachable: {WHY}"),
    (["watch", "--once"], f"  h1: unreachable: {WHY}"),
    (["lock", "--show"], f"h1: unreachable: {WHY}"),
    (["releases"], f"h1: unreachable: {WHY}"),
])
def test_an_unreachable_host_is_told_once_the_same_way(argv: list[str], line: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # The connection's retries back off 1 s and 2 s: skipped here, the refusal is the same each time.
    from ernie_deploy.remote import ssh
    monkeypatch.setattr(ssh, "time", SimpleNamespace(sleep=lambda seconds: None, monotonic=time.monotonic))
    inv = tmp_path / "inv.yml"
    inv.write_text("a:\n  hosts:\n    h1: {ansible_host: 127.0.0.250, ansible_port: 2, gpu_model: NVIDIA A10, "
                   "gpu_count: 1}\n")
    assert main([*argv, "-i", str(inv)]) == ExitCode.UNREACHABLE
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "unreachable: unreachable" not in text and "h1: h1:" not in text and text.count(WHY) == 1 + (
        argv[0] == "watch"), text  # watch tells the round, then its end
    first, _, rest = line.partition("{}")
    shown = [ln for ln in text.splitlines() if ln.startswith(first) and ln.endswith(rest or first)]
    assert shown, text
    assert "fix: check that the host (and any jump host) is up and sshd listens there" in text
