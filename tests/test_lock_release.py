"""Releasing the deploy lock says what happened: released, taken over by another run, gone, or not removable.
The release script runs in a real shell against a lock directory under tmp_path."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ernie_deploy.errors import DeployError
from ernie_deploy.remote import lock
from ernie_deploy.remote.ssh import RunResult


def release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info: str | None, token: str = "mine") -> RunResult:
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "lock"))
    if info is not None:
        (tmp_path / "lock").mkdir()
        (tmp_path / "lock" / "info").write_text(info + "\n")
    done = subprocess.run(["sh", "-c", lock.release_command(token).script], capture_output=True, timeout=10)
    return RunResult("release lock", done.returncode, done.stdout, done.stderr)


def held_by(token: str) -> str:
    return lock.LockInfo(token, "alice", "ops1", 7, "ernie-deploy deploy", 0.0).to_json()


def test_our_lock_is_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = release(tmp_path, monkeypatch, held_by("mine"))
    lock.check_release(result, "h1")
    assert not (tmp_path / "lock").exists()


def test_a_lock_taken_over_is_kept_and_reported_with_its_holder(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    result = release(tmp_path, monkeypatch, held_by("theirs"))
    with pytest.raises(DeployError, match=r"not ours any more: held by alice@ops1 \(pid 7\)") as caught:
        lock.check_release(result, "h1")
    assert caught.value.where == "h1" and (tmp_path / "lock" / "info").exists()


def test_a_lock_already_gone_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeployError, match="was gone already"):
        lock.check_release(release(tmp_path, monkeypatch, None), "h1")


def test_a_failed_removal_is_reported_with_its_error() -> None:
    err = b"rm: cannot remove '/var/lib/ernie-deploy/lock': Read-only file system\n"
    with pytest.raises(DeployError, match=r"failed: rm: cannot remove .*Read-only file system") as caught:
        lock.check_release(RunResult("release lock", 1, b"", err), "h1")
    assert "rm -rf" in (caught.value.hint or "")
