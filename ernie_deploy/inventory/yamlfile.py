"""YAML for inventories and vars files: Ansible's `!unsafe` and `!vault`, files encrypted whole by ansible-vault,
and the line of every key for error messages."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.vault import NO_PASSWORD_HINT, is_vaulted


class Unsafe(str):
    """A `!unsafe` string. ansible-inventory prints it as {"__ansible_unsafe": text}."""


class Vaulted:
    """A `!vault` value: ansible-vault ciphertext, decrypted only where the value is used (inventory/resolve.py).
    ansible-inventory prints it as {"__ansible_vault": text}; it is never a string, so it cannot pass for one."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return "Vaulted(...)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vaulted) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


# Decrypts an ansible-vault text: (text, what it is, where it is), the last two for the error when it cannot.
Decrypt = Callable[[str, str, str], str]


class Marked(dict[Any, Any]):
    """A YAML mapping that remembers its own line and the line of each key, for error messages."""

    line: int = 0
    key_lines: dict[Any, int]


# libyaml's parser is several times faster on fleet-sized inventories and reports the same marks.
# Both loaders share SafeConstructor's API, which is all Loader uses; mypy is shown the pure-Python one.
if TYPE_CHECKING:
    _SafeBase = yaml.SafeLoader
else:
    _SafeBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Loader(_SafeBase):
    def _construct_marked_map(self, node: yaml.MappingNode) -> Iterator[Marked]:
        data = Marked()
        data.line = node.start_mark.line + 1
        data.key_lines = {}
        yield data
        data.update(self.construct_mapping(node))
        # construct_mapping has flattened `<<` merges into node.value; keys are memoised by node.
        for key_node, _ in node.value:
            data.key_lines.setdefault(self.construct_object(key_node), key_node.start_mark.line + 1)

    def _construct_unsafe(self, node: yaml.Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return Unsafe(self.construct_scalar(node))
        raise yaml.constructor.ConstructorError(
            None, None, "!unsafe is supported on strings only", node.start_mark)

    def _construct_vault(self, node: yaml.Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return Vaulted(self.construct_scalar(node))
        raise yaml.constructor.ConstructorError(
            None, None, "!vault is supported on strings only", node.start_mark)


Loader.add_constructor("tag:yaml.org,2002:map", Loader._construct_marked_map)
Loader.add_constructor("!unsafe", Loader._construct_unsafe)
Loader.add_constructor("!vault", Loader._construct_vault)


def load_yaml(path: Path, shown: str, decrypt: Decrypt | None = None) -> Any:
    """A YAML file's data; a file encrypted whole by ansible-vault is decrypted first, as Ansible's loader does."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read the file: {exc}", where=shown,
                             hint="check the path and that the file is UTF-8 text") from None
    if is_vaulted(text):
        if decrypt is None:
            raise InventoryError("the file is encrypted with ansible-vault and no vault password was given",
                                 where=shown, hint=NO_PASSWORD_HINT)
        text = decrypt(text, "the file", shown)
    try:
        return yaml.load(text, Loader=Loader)  # Loader is a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise InventoryError(f"invalid YAML: {exc.problem or exc.context}", where=f"{shown}{line}",
                             hint="fix the YAML syntax at that line (indentation, quoting, a missing ':')"
                             ) from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"invalid YAML: {exc}", where=shown, hint="fix the YAML syntax") from None


def plain(value: Any) -> Any:
    """Turn loader mappings into plain dicts (and copy shared YAML aliases) so vars are independent."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def json_key(key: Any) -> str:
    """A mapping key as JSON writes it, which is what `ansible-inventory --list` prints (0 → "0", true → "true",
    null → "null"); YAML allows any scalar as a key, JSON only strings."""
    if isinstance(key, str):
        return key
    if isinstance(key, (date, datetime)):
        return key.isoformat()
    return json.dumps(key) if isinstance(key, (bool, int, float)) or key is None else str(key)


def to_json(value: Any, *, mark_unsafe: bool = True) -> Any:
    """Shape a value the way `ansible-inventory --list` does (`!unsafe` becomes a marker dict; `--host` prints
    it as a plain string: mark_unsafe=False)."""
    if isinstance(value, Unsafe):
        return {"__ansible_unsafe": str(value)} if mark_unsafe else str(value)
    if isinstance(value, Vaulted):
        return {"__ansible_vault": value.text}
    if isinstance(value, dict):
        return {json_key(k): to_json(v, mark_unsafe=mark_unsafe) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v, mark_unsafe=mark_unsafe) for v in value]
    if isinstance(value, (date, datetime)):  # YAML timestamps: ansible-inventory prints them as ISO text
        return value.isoformat()
    return value


_TYPE_NAMES: dict[type, str] = {dict: "a mapping", list: "a list", str: "a string"}


def type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)
