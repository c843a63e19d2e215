"""A reading of ExecStart= that follows systemd's documented rules, for tests of what units pass on."""

from __future__ import annotations

import re


def unsystemd(line: str) -> list[str]:
    """Split an ExecStart= value the way systemd documents it (systemd.service(5), systemd.syntax(7)):
    `%%` is a literal %, any other specifier is an error here; words split on whitespace with double/single
    quotes and C escapes; `$$` is a literal $, `$NAME` would be expanded (an error here)."""
    out = []
    for w in _words(line):
        if re.search(r"\$[^$]", w.replace("$$", "")):
            raise AssertionError(f"variable expansion in {w!r}")
        out.append(w.replace("$$", "$"))
    return out


def unsystemd_environment(line: str) -> dict[str, str]:
    """The variables an Environment= value sets (systemd.exec(5)): the same words as ExecStart=, but `$`
    has no special meaning there."""
    return dict(word.split("=", 1) for word in _words(line))


def _words(line: str) -> list[str]:
    """Specifiers (`%%` only), then words split on whitespace with double/single quotes and C escapes."""
    if re.search(r"%[^%]", line.replace("%%", "")):
        raise AssertionError(f"unescaped specifier in {line!r}")
    line = line.replace("%%", "%")
    words, i, n = [], 0, len(line)
    escapes = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "s": " "}
    while i < n:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            break
        word, quote = "", None
        while i < n and (quote or line[i] not in " \t"):
            c = line[i]
            if c == "\\" and i + 1 < n:
                word += escapes[line[i + 1]]
                i += 2
                continue
            if quote is None and c in "\"'":
                quote = c
            elif c == quote:
                quote = None
            else:
                word += c
            i += 1
        assert quote is None, f"unterminated quote in {line!r}"
        words.append(word)
    return words
