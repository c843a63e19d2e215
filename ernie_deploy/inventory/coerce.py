"""Inventory values typed the way Ansible's own modules type their arguments (module_utils/common/validation.py:
check_type_int, check_type_float, check_type_bool): an INI inventory's `[group:vars]` and `-e key=value` give
strings, so a setting that wants a number or a boolean takes "2" as 2 and "yes" as true. Anything else is left
as it is, for the setting's own check to name."""

from __future__ import annotations

from typing import Any

# ansible.module_utils.parsing.convert_bool: BOOLEANS_TRUE / BOOLEANS_FALSE (strings compared lower-cased).
TRUE_WORDS = frozenset({"y", "yes", "on", "1", "true", "t"})
FALSE_WORDS = frozenset({"n", "no", "off", "0", "false", "f"})


def coerce(value: Any, kinds: tuple[type, ...]) -> Any:
    """`value` as the first of `kinds` a string converts to, as Ansible would; unchanged when it is not a string
    or a string is one of `kinds` already."""
    if not isinstance(value, str) or str in kinds:
        return value
    for kind in kinds:
        if kind is bool and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS
        if kind is int:
            try:
                return int(value)
            except ValueError:
                continue
        if kind is float:
            try:
                return float(value)
            except ValueError:
                continue
    return value
