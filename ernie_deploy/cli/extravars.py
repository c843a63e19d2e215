"""`-e/--extra-vars` read the way ansible-core's load_extra_vars reads them: `@FILE` (YAML or JSON, encrypted
whole by ansible-vault or not), an inline YAML/JSON mapping, or `key=value` words whose values stay strings.
Later options win, key by key."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.yamlfile import Decrypt, Loader, load_yaml, plain

_HINT = "give key=value words, a YAML/JSON mapping such as '{\"vllm_tp\": 2}', or @FILE"


def parse_extra_vars(options: Sequence[str], decrypt: Decrypt | None) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for number, option in enumerate(options, 1):
        if not option:
            continue
        # Named by position, never by its text: a value may be a secret.
        where = f"-e/--extra-vars #{number}"
        if option.startswith("@"):
            data = load_yaml(Path(option[1:]).expanduser(), option[1:], decrypt)
        elif option[0] in "/.":
            raise InventoryError("an extra-vars file must start with @", where=where, hint="write -e @FILE")
        elif option[0] in "[{":
            try:
                data = yaml.load(option, Loader=Loader)  # Loader is a SafeLoader subclass
            except yaml.YAMLError as exc:
                raise InventoryError(f"invalid YAML/JSON: {exc}", where=where, hint=_HINT) from None
        else:
            data = _key_values(option, where)
        if not isinstance(data, dict):
            raise InventoryError("extra vars must be a mapping of variables", where=where, hint=_HINT)
        for key in data:
            if not isinstance(key, str) or not key:
                raise InventoryError(f"variable name must be a string, got {key!r}", where=where, hint=_HINT)
        found.update(plain(data))
    return found


def _key_values(option: str, where: str) -> dict[str, str]:
    try:
        words = shlex.split(option)
    except ValueError as exc:
        raise InventoryError(f"cannot split the words: {exc}", where=where, hint="close the quote") from None
    found: dict[str, str] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise InventoryError(f"word {len(found) + 1} is not key=value", where=where, hint=_HINT)
        found[key] = value
    return found
