"""The SSH session's run, against a fake channel: what it reads and how it waits."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from ernie_deploy.remote.command import script
from ernie_deploy.remote.ssh import Session, Target


class _Window:
    """A channel whose stdout only ends once its stderr was read, as a real one whose window is full of stderr
    (paramiko #1778): reading stdout first, then stderr, would wait forever."""

    def __init__(self) -> None:
        self.stderr_read = threading.Event()
        self.channel = SimpleNamespace(shutdown_write=lambda: None, recv_exit_status=lambda: 0)
        self.written: list[bytes] = []

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
