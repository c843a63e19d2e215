"""rich's two consoles, made when something is first printed through them (output/console.py): a run whose
output is JSON alone never imports rich."""

from __future__ import annotations

import errno
import os
import sys

from rich.console import Console


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
