"""Reading the project's YAML/JSON data files with errors that name the file, line and key path."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml

from ernie_deploy.errors import ConfigError

# libyaml's parser, where PyYAML was built with it: every command reads the bundled tables (recommendations,
# GPUs, vLLM versions) first, and the pure-Python parser took about 9 ms of a no-change deploy's start-up for them.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def bundled(name: str) -> Path:
    """Path of a file shipped in ernie_deploy/data."""
    return Path(str(resources.files("ernie_deploy") / "data" / name))


def load_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", where=str(path)) from exc
    try:
        return yaml.load(text, Loader=_LOADER)  # a SafeLoader: plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML: {problem}", where=where) from exc


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", where=str(path)) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON: {exc.msg}", where=f"{path}:{exc.lineno}") from exc


_T = TypeVar("_T")


@overload
def expect(value: Any, kind: type[_T], where: str, key: str) -> _T: ...


@overload
def expect(value: Any, kind: tuple[type, ...], where: str, key: str) -> Any: ...


def expect(value: Any, kind: type | tuple[type, ...], where: str, key: str) -> Any:
    """Return value if it has the expected type, else a ConfigError naming the key path."""
    # bool is an int in Python; a YAML `true` where a number belongs is a mistake, not a 1.
    if (isinstance(value, bool) and kind in (int, float, (int, float))) or not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}", where=where)
    return value


def mapping(value: Any, where: str, key: str) -> Mapping[str, Any]:
    checked: dict[str, Any] = expect(value if value is not None else {}, dict, where, key)
    return checked
