"""All terminal output goes through here; the only module that imports rich."""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (`| head`): rich would exit 1 here; the command line's one handler
        (cli/main.py) stops every such case the same way."""
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


# Rich falls back to 80 columns when output is piped, which truncates plan tables; use COLUMNS or 140.
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "140"))
out = _Console(highlight=False, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # errors stay one greppable line


def verbatim(text: str) -> None:
    """Text that must reach the reader line for line (diffs): never wrapped, cropped or styled, so a long line
    never continues on a line that reads as something else (a diff's removal)."""
    out.print(text, markup=False, highlight=False, soft_wrap=True, end="" if text.endswith("\n") else "\n")


def error(problem: object) -> None:
    """An error that ends a command (or a host's part in it): one greppable line, then any fix."""
    err.print(f"error: {problem}", markup=False, highlight=False)


def note(text: str) -> None:
    """A line for the operator beside the output: progress, warnings, what the command is doing."""
    err.print(text, markup=False)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colour, no wrapping."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=title, title_justify="left")
    for column in columns:
        t.add_column(column)
    for row in rows:
        t.add_row(*(str(cell) for cell in row))
    out.print(t)


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on stderr for long work; silent when stderr is not a terminal."""
    if err.is_terminal:
        with err.status(message):
            yield
    else:
        err.print(message)
        yield


class HostProgress:
    """Live per-host status on stderr while long multi-host work runs, on a terminal only: piped or logged, a
    run prints its results and nothing of its progress (the issue's Output rule, as Ansible does)."""

    def __init__(self, title: str) -> None:
        import threading

        from rich.live import Live

        self.title = title
        self.state: dict[str, str] = {}
        self._lock = threading.Lock()
        self._live = Live(console=err, refresh_per_second=8, transient=True) if err.is_terminal else None

    def _render(self) -> Table:
        t = Table(title=self.title, title_justify="left", show_header=False, box=None)
        for host, what in self.state.items():
            t.add_row(host, what)
        return t

    def update(self, host: str, what: str) -> None:
        with self._lock:
            self.state[host] = what
            if self._live is not None:
                self._live.update(self._render())

    def __enter__(self) -> HostProgress:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
