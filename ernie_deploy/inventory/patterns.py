"""Host ranges, `host:port` keys and `--limit` patterns, with the semantics of ansible-core.

Kept apart from inventory.py because these are pure string functions: they know nothing about files.
Every rule here was checked against ansible-core's inventory plugin base and InventoryManager.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
import string
from collections.abc import Callable, Sequence

from ernie_deploy.errors import InventoryError

# A host label may contain [a:b] / [01:10:2] ranges; Ansible's address grammar accepts them there.
_RANGE = r"\[(?:[a-z]:[a-z]|[0-9]+:[0-9]+)(?::[0-9]+)?\]"
_LABEL = rf"(?:\w|{_RANGE})(?:[\w-]|{_RANGE})*(?<![_-])"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$", re.I)
_BRACKETED_HOSTPORT = re.compile(r"^\[(.+)\]:([0-9]+)$")
# Anything but ':' outside brackets, then :PORT; an unbracketed IPv6 address never matches.
_HOSTPORT = re.compile(r"^((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)$")
_SUBSCRIPT = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]*))\]$")
_PATTERN_WORD = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")


def parse_address(text: str) -> tuple[str, int | None] | None:
    """Split `host[:port]` the way Ansible does; None when `text` is not a host identifier at all."""
    port: int | None = None
    match = _BRACKETED_HOSTPORT.match(text) or _HOSTPORT.match(text)
    if match:
        text, port = match.group(1), int(match.group(2))
    if _HOSTNAME.match(text) or _is_ipv6(text):
        return text, port
    return None


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def expand_host_key(key: str) -> tuple[list[str], int | None]:
    """Expand an inventory host key such as `gpu-[01:04].dc1:2222` into names and an optional port.

    Raises ValueError with Ansible's wording; the caller adds the file and line.
    """
    parsed = parse_address(key)
    # Ansible keeps an unparseable key verbatim (no port) and still expands any ranges in it.
    pattern, port = parsed if parsed else (key, None)
    return (expand_ranges(pattern) if "[" in pattern else [pattern]), port


def expand_ranges(pattern: str) -> list[str]:
    """Expand the first [beg:end(:step)] range, then recurse for the rest (as Ansible does)."""
    head, _, rest = pattern.partition("[")
    spec, closed, tail = rest.partition("]")
    if not closed:
        raise ValueError(f"unterminated host range in '{pattern}'")
    bounds = spec.split(":")
    if len(bounds) not in (2, 3):
        raise ValueError("host range must be begin:end or begin:end:step")
    beg, end = bounds[0] or "0", bounds[1]
    step = int(bounds[2]) if len(bounds) == 3 and bounds[2] else 1
    if not end:
        raise ValueError("host range must specify end value")
    if step <= 0:
        raise ValueError("host range step must be a positive number")
    names: list[str] = []
    for item in _range_items(beg, end, step):
        name = f"{head}{item}{tail}"
        names.extend(expand_ranges(name) if "[" in name else [name])
    return names


def _range_items(beg: str, end: str, step: int) -> list[str]:
    letters = string.ascii_letters
    if beg in letters and end in letters and len(beg) == len(end) == 1:
        if letters.index(beg) > letters.index(end):
            raise ValueError("host range must have begin <= end")
        return list(letters[letters.index(beg) : letters.index(end) + 1 : step])
    width = len(beg) if beg.startswith("0") and len(beg) > 1 else 0
    if width and width != len(end):
        raise ValueError("host range must specify equal-length begin and end formats")
    try:
        numbers = range(int(beg), int(end) + 1, step)
    except ValueError:
        raise ValueError(f"host range bounds must be numbers or single letters, got '{beg}:{end}'") from None
    return [str(n).zfill(width) for n in numbers]


def split_pattern(pattern: str) -> list[str]:
    """Split a host pattern into terms: on ',' if present, else on ':' outside brackets.

    A whole pattern that parses as an address (`host`, `web[1:3]`, `::1`) stays one term, which is
    why Ansible recommends ',' over ':'.
    """
    if "," in pattern:
        terms = pattern.split(",")
    elif parse_address(pattern) is not None:
        terms = [pattern]
    else:
        terms = _PATTERN_WORD.findall(pattern)
    return [term.strip() for term in terms if term.strip()]


def order_terms(terms: Sequence[str]) -> list[str]:
    """Unions first, then intersections (&), then exclusions (!); no union term means `all`."""
    union = [t for t in terms if t[0] not in "&!"]
    return (union or ["all"]) + [t for t in terms if t[0] == "&"] + [t for t in terms if t[0] == "!"]


class PatternMatcher:
    """Evaluates host patterns against one inventory exactly like InventoryManager.get_hosts."""

    def __init__(
        self, group_names: Sequence[str], host_names: Sequence[str], group_hosts: Callable[[str], list[str]]
    ) -> None:
        self._groups = list(group_names)  # in inventory creation order, 'all' and 'ungrouped' first
        self._hosts = list(host_names)  # in creation order (not the 'all' order)
        self._known = set(host_names)
        self._group_hosts = group_hosts

    def evaluate(self, pattern: str) -> list[str]:
        hosts: list[str] = []
        for term in order_terms(split_pattern(pattern)):
            if term in self._known:
                hosts.append(term)  # an exact host name short-cuts matching, as in Ansible
                continue
            matched = self._match_term(term)
            if term[0] == "!":
                hosts = [h for h in hosts if h not in set(matched)]
            elif term[0] == "&":
                hosts = [h for h in hosts if h in set(matched)]
            else:
                hosts.extend(h for h in matched if h not in set(hosts))
        return list(dict.fromkeys(hosts))

    def unmatched_terms(self, pattern: str) -> list[str]:
        """Terms that match no group and no host (Ansible warns about each and ignores it)."""
        terms = [t[1:] if t[0] in "&!" else t for t in split_pattern(pattern)]
        return [t for t in terms if t != "all" and t not in self._known and not self._match_term(t)]

    def _match_term(self, term: str) -> list[str]:
        expr, subscript = _split_subscript(term[1:] if term[0] in "&!" else term)
        hosts = self._enumerate(expr)
        if not hosts or subscript is None:
            return hosts
        start, end = subscript
        if not end:  # Ansible treats [n:0] like [n] (its code tests `if end:`)
            if not -len(hosts) <= start < len(hosts):
                raise InventoryError(f"no hosts matched the subscripted pattern '{term}'",
                                     hint=f"'{expr}' matches {len(hosts)} hosts; index from 0")
            return [hosts[start]]
        return hosts[start : (len(hosts) if end == -1 else end + 1)]

    def _enumerate(self, expr: str) -> list[str]:
        regex = _compile(expr)
        groups = [g for g in self._groups if regex.match(g)]
        results = [h for g in groups for h in self._group_hosts(g)]
        # Host names are tried when no group matched, or when the term is a glob/regex.
        if not groups or expr[0] == "~" or any(c in expr for c in ".?*["):
            results.extend(h for h in self._hosts if regex.match(h))
        return list(dict.fromkeys(results))


def _split_subscript(term: str) -> tuple[str, tuple[int, int | None] | None]:
    if term[0] == "~":
        return term, None  # in a regex the brackets belong to the regex
    match = _SUBSCRIPT.match(term)
    if not match:
        return term, None
    expr, index, start, _sep, end = match.groups()
    if index:
        return expr, (int(index), None)
    return expr, (int(start), int(end) if end else -1)


def _compile(expr: str) -> re.Pattern[str]:
    try:
        # `~regex` is matched from the start of the name (re.match), a glob against the whole name.
        return re.compile(expr[1:] if expr[0] == "~" else fnmatch.translate(expr))
    except re.error as exc:
        raise InventoryError(f"invalid host pattern '{expr}': {exc}",
                             hint="fix the regular expression after '~', or quote glob characters") from None
