"""All terminal output goes through here; rich, which prints it, is loaded on first use (output/terminal.py)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table


def __getattr__(name: str) -> Console:
    """`out` and `err` (output/terminal.py), imported on first use: `console.out.print(...)` works as before,
    and a --json run, which prints through neither, does not import rich (about 10 ms of its start-up)."""
    if name in ("out", "err"):
        from ernie_deploy.output import terminal
        console: Console = getattr(terminal, name)
        return console
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _out() -> Console:
    return __getattr__("out")


def _err() -> Console:
    return __getattr__("err")


def _stderr_is_terminal() -> bool:
    """Whether rich takes stderr for a terminal, without loading rich where its answer is no: a stderr that is
    not a tty, with neither TTY_COMPATIBLE=1 nor a non-empty FORCE_COLOR (the variables rich 15's
    Console.is_terminal reads before isatty), is none for rich either."""
    if not sys.stderr.isatty() and os.environ.get("TTY_COMPATIBLE") != "1" and not os.environ.get("FORCE_COLOR"):
        return False
    return _err().is_terminal


def literal(text: str) -> str:
    """Text to place in a markup line as it is: brackets in it (`[tp-heads]`) are not read as style tags."""
    from rich.markup import escape
    return escape(text)


def verbatim(text: str) -> None:
    """Text that must reach the reader line for line (diffs): never wrapped, cropped or styled, so a long line
    never continues on a line that reads as something else (a diff's removal)."""
    _out().print(text, markup=False, highlight=False, soft_wrap=True, end="" if text.endswith("\n") else "\n")


def error(problem: object) -> None:
    """An error that ends a command (or a host's part in it): one greppable line, then any fix."""
    _err().print(f"error: {problem}", markup=False, highlight=False)


def note(text: str) -> None:
    """A line for the operator beside the output: progress, warnings, what the command is doing."""
    _err().print(text, markup=False)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colour, no wrapping."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Aligned columns in plain lines, never cut: on a narrow terminal a line runs long and the terminal wraps
    it, where a drawn table would shrink its columns and cut the values (a GPU list, the KV tokens) to `…`."""
    cells = [list(columns), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    if title:
        verbatim(title)
    verbatim(line(cells[0]))
    verbatim(line(["─" * w for w in widths]))
    for row in cells[1:]:
        verbatim(line(row))


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on stderr for long work; silent when stderr is not a terminal."""
    if _stderr_is_terminal():
        with _err().status(message):
            yield
    else:
        _err().print(message)
        yield


class HostProgress:
    """Live per-host status on stderr while long multi-host work runs, on a terminal only: piped or logged, a
    run prints its results and nothing of its progress (the issue's Output rule, as Ansible does)."""

    def __init__(self, title: str) -> None:
        import threading

        self.title = title
        self.state: dict[str, str] = {}
        self._lock = threading.Lock()
        self._live: Live | None = None
        if _stderr_is_terminal():
            from rich.live import Live

            self._live = Live(console=_err(), refresh_per_second=8, transient=True)

    def _render(self) -> Table:
        from rich.table import Table

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
