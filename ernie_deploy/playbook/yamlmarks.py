"""YAML with line numbers: every mapping key and list item keeps the line it came from, so a mistake deep in
a playbook is reported as FILE:LINE and its key path (`plays[0].tasks[2].verify.expect[1]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.errors import ConfigError


@dataclass
class Marked:
    """A loaded document and the line of each key path in it."""

    path: Path
    data: Any
    lines: dict[str, int] = field(default_factory=dict)

    def where(self, key: str) -> str:
        """FILE:LINE of a key path, falling back to its nearest parent that has a line."""
        probe = key
        while probe and probe not in self.lines:
            probe = _parent(probe)
        line = self.lines.get(probe)
        return f"{self.path}:{line}" if line else str(self.path)

    def error(self, key: str, message: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{key}: {message}" if key else message, where=self.where(key), hint=hint)


def _parent(key: str) -> str:
    if key.endswith("]"):
        return key[: key.rindex("[")]
    return key.rsplit(".", 1)[0] if "." in key else ""


def load(path: Path, root: str = "") -> Marked:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", where=str(path)) from exc
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"malformed YAML: {getattr(exc, 'problem', None) or exc}", where=where) from exc
    marked = Marked(path, None)
    if node is not None:
        marked.lines[""] = node.start_mark.line + 1
        marked.data = _build(node, root, marked, yaml.constructor.SafeConstructor())
    return marked


def _build(node: yaml.Node, key: str, marked: Marked, scalars: yaml.constructor.SafeConstructor) -> Any:
    marked.lines.setdefault(key, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for k_node, v_node in node.value:
            if k_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigError("YAML merge keys (<<) are not supported in playbooks",
                                  where=f"{marked.path}:{k_node.start_mark.line + 1}")
            name = _scalar(k_node, marked, scalars)
            child = f"{key}.{name}" if key else str(name)
            if name in out:
                raise ConfigError(f"{child}: duplicate key (YAML keeps only the last one, which hides a mistake)",
                                  where=f"{marked.path}:{k_node.start_mark.line + 1}")
            marked.lines[child] = k_node.start_mark.line + 1
            out[name] = _build(v_node, child, marked, scalars)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, f"{key}[{i}]", marked, scalars) for i, item in enumerate(node.value)]
    return _scalar(node, marked, scalars)


def _scalar(node: yaml.Node, marked: Marked, scalars: yaml.constructor.SafeConstructor) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise ConfigError("a key must be a plain value, not a list or mapping",
                          where=f"{marked.path}:{node.start_mark.line + 1}")
    return scalars.construct_object(node, deep=True)
