"""The host-output protocol: how the scripts ernie-deploy runs on a host mark up what they print, and the one
reader of it.

A script prints marker lines, `@@ernie-deploy:HEADER`, and what follows a marker up to the next one is that
section's body; one failing command is then a fact in its section, not a failed round trip. Some markers
carry a one-line record instead (`@@ernie-deploy:TAG PAYLOAD`: an HTTP answer, a release record): `records`
reads those, and `sections` keeps them inside the section they appear in when told their tags. sha256sum's
output has its one parser here too, since several scripts print it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MARK = "@@ernie-deploy:"
# The shell function the section scripts start with: `m NAME` opens section NAME. The leading newline ends a
# body whose last line had none, so the marker always starts a line.
MARK_FUNCTION = f"m() {{ printf '\\n{MARK}%s\\n' \"$1\"; }}"


@dataclass(frozen=True)
class Section:
    header: str  # what follows the marker: "gpus", "unit ernie-vllm-0.service", "journal UNIT INVOCATION"
    lines: tuple[str, ...] = ()  # the body's lines, without their line endings
    raw: tuple[str, ...] = ()  # the same lines as printed, line endings kept (a file's exact content)

    @property
    def kind(self) -> str:
        """The header's first word."""
        return self.header.partition(" ")[0]

    @property
    def arg(self) -> str:
        """The rest of the header after its first word (a unit's name, a path)."""
        return self.header.partition(" ")[2]

    @property
    def body(self) -> str:
        return "\n".join(self.lines).strip("\n")


def marker(tag: str) -> str:
    """The prefix of a one-line record, `@@ernie-deploy:TAG `."""
    return f"{MARK}{tag} "


def split(text: str, records: Iterable[str] = ()) -> list[Section]:
    """The sections of `text` in order (lines before the first marker belong to none). Lines that are records
    of the `records` tags stay body lines of the section they are in."""
    inline = tuple(marker(tag) for tag in records)
    out: list[Section] = []
    header: str | None = None
    lines: list[str] = []
    raw: list[str] = []
    for line, as_printed in zip(text.splitlines(), text.splitlines(keepends=True), strict=True):
        if line.startswith(MARK) and not (inline and line.startswith(inline)):
            if header is not None:
                out.append(Section(header, tuple(lines), tuple(raw)))
            header, lines, raw = line[len(MARK):].strip(), [], []
        elif header is not None:
            lines.append(line)
            raw.append(as_printed)
    if header is not None:
        out.append(Section(header, tuple(lines), tuple(raw)))
    return out


def sections(text: str) -> dict[str, str]:
    """Section bodies by header (a later section of the same header wins), for scripts whose headers are
    unique."""
    return {s.header: s.body for s in split(text) if s.header}


def records(text: str, tag: str) -> list[str]:
    """The payloads of the `@@ernie-deploy:TAG PAYLOAD` lines, in order."""
    prefix = marker(tag)
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def sha256sums(text: str) -> dict[str, str]:
    """`sha256sum`'s `DIGEST  PATH` lines as path → digest (other lines, an error message, are skipped)."""
    out = {}
    for line in text.splitlines():
        digest, _, path = line.partition("  ")
        if len(digest) == 64 and path:
            out[path] = digest
    return out
