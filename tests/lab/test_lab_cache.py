"""The lab's build cache under concurrent use: scripts/test boots the simulated and the real-vLLM lab from two
pytest processes at once, so on a fresh machine both reach rootfs.ensure_rootfs together and one of them goes
on to realvllm.ensure_index. The builds themselves (debootstrap, pip download) are replaced by slow fakes that
record what ran and whether another build was running at the same time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ernie_deploy.lab import realvllm, rootfs


class Builds:
    """What the fake builds saw: each build's name, and the most builds ever running at once."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.running = 0
        self.most_at_once = 0
        self._guard = threading.Lock()

    def run(self, name: str, target: Path) -> None:
        with self._guard:
            self.names.append(name)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        target.mkdir(parents=True, exist_ok=True)
        time.sleep(0.3)  # long enough for the other thread to reach the lock while this build runs
        assert target.is_dir(), f"{name}'s build directory was removed while it ran"
        with self._guard:
            self.running -= 1


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Builds:
    seen = Builds()
    monkeypatch.setattr(rootfs, "_debootstrap", lambda target, progress: seen.run("rootfs", target))
    monkeypatch.setattr(rootfs, "_customize", lambda root: None)
    monkeypatch.setattr(realvllm, "_download", lambda target: seen.run("index", target))
    return seen


def together(*calls: Callable[[], tuple[Path, float | None]]) -> list[tuple[Path, float | None]]:
    """Run the calls in threads released at the same instant; their results in order (re-raising a failure)."""
    start = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def one(i: int, call: Callable[[], tuple[Path, float | None]]) -> None:
        start.wait()
        try:
            results[i] = call()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def quiet(_message: str) -> None:
    return None


def test_two_labs_booting_at_once_build_the_root_file_system_once(builds: Builds, tmp_path: Path) -> None:
    first, second = together(lambda: rootfs.ensure_rootfs(quiet, tmp_path),
                             lambda: rootfs.ensure_rootfs(quiet, tmp_path))
    assert builds.names == ["rootfs"]
    assert first[0] == second[0] == rootfs.rootfs_path(tmp_path)
    # One built it (and says how long it took), the other waited and found it cached.
    assert sorted(r[1] is None for r in (first, second)) == [False, True]
    assert (first[0] / ".ernie-lab-rootfs").is_file()
    assert not list(tmp_path.glob(".build-*"))


def test_a_root_file_system_build_and_an_index_build_at_once_both_finish_one_after_the_other(
        builds: Builds, tmp_path: Path) -> None:
    (tree, _), (index, _) = together(lambda: rootfs.ensure_rootfs(quiet, tmp_path),
                                     lambda: realvllm.ensure_index(quiet, tmp_path))
    assert sorted(builds.names) == ["index", "rootfs"]
    assert builds.most_at_once == 1  # one lock for every build into the cache: neither cleans up the other's
    assert (tree / ".ernie-lab-rootfs").is_file()
    assert (index / ".complete").is_file() and (index / "simple" / "vllm" / "index.html").is_file()
    assert not list(tmp_path.glob(".build-*"))
    # Both are cache entries now: a second boot of either lab builds nothing.
    assert rootfs.ensure_rootfs(quiet, tmp_path) == (tree, None)
    assert realvllm.ensure_index(quiet, tmp_path) == (index, None)
    assert len(builds.names) == 2
