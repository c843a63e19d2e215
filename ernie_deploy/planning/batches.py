"""Rollout batches and the failure rule that stops a rollout, the way Ansible does it.

Operators come from ansible-playbook and already know what `serial: [1, 2, "50%"]` and
`max_fail_percentage: 30` do; a rollout that formed its batches slightly differently (a percentage of the
remaining hosts instead of the total, rounding up instead of down, a last item that does not repeat) would
take down more servers than they planned for. So this module copies ansible-core's behaviour exactly:

* batches: `PlaybookExecutor._get_serialized_batches` (lib/ansible/executor/playbook_executor.py) with
  `pct_to_int` (lib/ansible/utils/helpers.py);
* stopping: the `max_fail_percentage` check of the linear strategy (lib/ansible/plugins/strategy/linear.py)
  and the "whole batch failed" check in `PlaybookExecutor.run`;
* `--max-fail-percentage` accepts what Ansible's `percent` field type accepts (lib/ansible/playbook/base.py).

tests/test_batches.py runs the real ansible-playbook to keep the batches equal to Ansible's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TypeVar

from ernie_deploy.errors import DeployError

T = TypeVar("T")

SerialItem = int | str
"""A batch size: a host count (`3`; 0 or less means "all remaining hosts") or a percentage (`"30%"`)."""

SERIAL_HINT = ('use a host count, a percentage of all hosts or a comma-separated list of them, e.g. '
               '--serial 3, --serial 30%, --serial 1,2,50% (0 means "all remaining hosts")')
PERCENTAGE_HINT = "use a number from 0 to 100, optionally with %: --max-fail-percentage 30 (or 30%, 30.5)"

# ASCII digits only: int() would also take "٣" or "1_0", which nobody means to type.
_COUNT = re.compile(r"\d+", re.ASCII)
_PERCENT = re.compile(r"(\d+)\s*%", re.ASCII)
_DECIMAL = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)


def _parse_item(text: str, *, whole: str) -> SerialItem:
    item = text.strip()
    if not item:
        raise DeployError(f"--serial {whole!r}: empty batch size", hint=SERIAL_HINT)
    if _COUNT.fullmatch(item):
        return int(item)
    match = _PERCENT.fullmatch(item)
    if match:
        percent = int(match.group(1))
        if percent > 100:
            raise DeployError(f"--serial {whole!r}: {item!r} is more than 100%", hint=SERIAL_HINT)
        return f"{percent}%"
    if item.startswith("-"):
        # Ansible would read a negative count as "all remaining hosts"; an operator who types one
        # more likely meant something else, and 0 already says "the rest" plainly.
        raise DeployError(f"--serial {whole!r}: negative batch size {item!r}", hint=SERIAL_HINT)
    if _DECIMAL.fullmatch(item.removesuffix("%").strip()):
        # Ansible reads "33.3%" with int("33.3") and fails, so only whole numbers exist.
        kind = "percentage" if item.endswith("%") else "host count"
        raise DeployError(f"--serial {whole!r}: {item!r} is not a whole {kind}", hint=SERIAL_HINT)
    raise DeployError(f"--serial {whole!r}: {item!r} is not a host count or a percentage", hint=SERIAL_HINT)


def parse_serial(text: str) -> list[SerialItem]:
    """`--serial` as typed ("3", "30%", "1, 2, 50%") → the list Ansible's `serial:` would hold."""
    if not text.strip():
        raise DeployError(f"--serial {text!r}: no batch size given", hint=SERIAL_HINT)
    return [_parse_item(part, whole=text) for part in text.split(",")]


def serial_of(text: str, where: str) -> list[SerialItem]:
    """A serial as typed (--serial, vllm_serial): "all" for every host at once (asked for by name), else
    parse_serial's forms (100% says what it does); a lone 0 (Ansible's "all remaining") is refused: it restarted
    every host at once without saying so."""
    if text.strip().lower() == "all":
        return [0]
    items = parse_serial(text)
    if items == [0]:
        raise DeployError(f"{where} {text}: every host at once", where=where,
                          hint="a change to serving instances rolls one host at a time by default; to take every "
                               f"host down at once say so by name: {where} all")
    return items


def _batch_size(item: SerialItem, total: int) -> int:
    if isinstance(item, str):
        parsed = _parse_item(item, whole=item)
        if isinstance(parsed, int):
            return parsed
        # Of the play's total, floored, but never 0: "10%" of 3 hosts is 1 host, not "all of them".
        return int((int(parsed[:-1]) / 100.0) * total) or 1
    return item


def _serialized(hosts: Sequence[T], serial: Sequence[SerialItem] | None) -> list[list[T]]:
    items: Sequence[SerialItem] = serial or [-1]
    total = len(hosts)
    remaining = list(hosts)
    batches: list[list[T]] = []
    index = 0
    while remaining:
        size = _batch_size(items[index], total)
        if size <= 0:
            batches.append(remaining)
            break
        batches.append(remaining[:size])
        remaining = remaining[size:]
        # The last item repeats until the hosts run out.
        index = min(index + 1, len(items) - 1)
    return batches


def form_batches(hosts: Sequence[T], serial: Sequence[SerialItem] | None, canary: int = 0) -> list[list[T]]:
    """Split `hosts` (in rollout order) into batches like Ansible's `serial`.

    `canary` > 0 first rolls out to that many hosts alone, as if they were a play of their own; the
    rest is then a second play, so its percentages are of the hosts left after the canary.
    """
    if canary < 0:
        raise DeployError(f"--canary {canary}: must be 0 (no canary) or a positive host count",
                          hint="use --canary 1 to try one host first, or leave it out")
    if not hosts:
        return []
    if canary == 0:
        return _serialized(hosts, serial)
    if canary >= len(hosts):
        return [list(hosts)]
    return [list(hosts[:canary]), *_serialized(hosts[canary:], serial)]


def batch_stops(failed: int, unreachable: int, size: int, max_fail_percentage: float | None) -> bool:
    """Whether a finished batch stops the rollout (no later batch starts)."""
    if size <= 0:
        return False
    # Checked in PlaybookExecutor independently of max_fail_percentage, so it holds even at 100.
    if failed + unreachable >= size:
        return True
    if max_fail_percentage is None:
        return False
    # Ansible's own comparison, kept in this form: (11 / 20) * 100 is 55.00000000000001 in floats and
    # would stop a batch that Ansible lets pass at max_fail_percentage 55. Unreachable hosts do not count.
    return failed / size > max_fail_percentage / 100.0


def parse_percentage(text: str) -> float:
    """`--max-fail-percentage` as typed ("30", "30%", "30.5") → a float from 0 to 100."""
    number = text.strip().removesuffix("%").strip()
    # A plain decimal only: float() would also take "nan", "inf" or "1e2".
    if not _DECIMAL.fullmatch(number):
        raise DeployError(f"--max-fail-percentage {text!r}: not a number", hint=PERCENTAGE_HINT)
    value = float(number)
    if value > 100:
        raise DeployError(f"--max-fail-percentage {text!r}: must be from 0 to 100", hint=PERCENTAGE_HINT)
    return value
