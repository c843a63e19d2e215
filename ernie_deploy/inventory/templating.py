"""Rendering one inventory value's `{{ }}` template (inventory/resolve.py says when): Jinja2, sandboxed so inventory
text cannot reach Python's internals, with native results as ansible-core 2.19 gives them, the lookups `env` and
`file`, and Ansible's common filters besides Jinja's own (docs/inventory-sources.md lists them). Imported only
when some value has a template, so a plain inventory costs no Jinja."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import PurePath
from typing import Any

import jinja2
from jinja2.nativetypes import NativeCodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.coerce import FALSE_WORDS, TRUE_WORDS
from ernie_deploy.inventory.resolve import HostVars, read_controller_file

LOOKUPS = ("env", "file")


def render(text: str, host: HostVars, key: str) -> Any:
    """The value of `text` for variable `key` of `host`; errors name the variable and its file."""
    return _render(text, _Context(host), key, host)


class _Context(Mapping[str, Any]):
    """What a template sees: the host's variables (resolved on use), Ansible's magic variables, the lookups."""

    def __init__(self, host: HostVars) -> None:
        self._host = host

    def __getitem__(self, key: str) -> Any:
        if key in self._host:
            return self._host[key]
        if key in self._host.magic:
            return self._host.magic[key]
        if key in _ENV.globals:
            return _ENV.globals[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self._host), **dict.fromkeys(self._host.magic)})

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, key: object) -> bool:
        return key in self._host or key in self._host.magic or key in _ENV.globals


class _Environment(ImmutableSandboxedEnvironment):
    # Native output, as ansible-core 2.19 templates: `{{ [1, 2] }}` is a list, not its text.
    code_generator_class = NativeCodeGenerator


def _render(text: str, context: _Context, key: str, host: HostVars) -> Any:
    try:
        template = _ENV.from_string(text)
        ctx = template.new_context(context, shared=True)  # type: ignore[arg-type]
        ctx.vars["lookup"] = _lookup(host, key, many=False)
        ctx.vars["query"] = ctx.vars["q"] = _lookup(host, key, many=True)
        parts = list(template.root_render_func(ctx))
        for part in parts:
            if isinstance(part, jinja2.Undefined):
                str(part)  # raises the UndefinedError naming the variable, as rendering it as text would
    except InventoryError:
        raise
    except jinja2.TemplateAssertionError as exc:
        name = re.search(r"No (filter|test) named '([^']+)'", str(exc))
        if name:
            kind = name.group(1)
            offered = f"Jinja's built-in {kind}s" + (f", or {', '.join(ANSIBLE_FILTERS)}" if kind == "filter" else "")
            raise host.error(key, f"the {kind} '{name.group(2)}' is not supported in inventory values",
                             f"use {offered} (docs/inventory-sources.md)") from None
        raise host.error(key, f"template error: {exc}", "fix the Jinja expression") from None
    except jinja2.UndefinedError as exc:
        raise host.error(key, f"{exc.message} in its template", "define that variable, or give a default with "
                         "`| default(VALUE)`") from None
    except jinja2.TemplateSyntaxError as exc:
        raise host.error(key, f"template syntax error: {exc.message}", "fix the Jinja expression") from None
    except jinja2.exceptions.SecurityError as exc:
        raise host.error(key, f"the template is not allowed: {exc}", "inventory templates may use variables, "
                         "filters and lookups only") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:
        # The exception's text may quote a value, and values may be secrets: its type only.
        raise host.error(key, f"the template failed ({type(exc).__name__})", "fix the Jinja expression") from None
    if len(parts) == 1:
        return parts[0]
    return "".join(str(p) for p in parts)


def _lookup(host: HostVars, key: str, *, many: bool) -> Callable[..., Any]:
    def lookup(name: str, *terms: Any, **options: Any) -> Any:
        plugin = name.removeprefix("ansible.builtin.")
        if plugin not in LOOKUPS:
            raise host.error(key, f"the lookup '{name}' is not supported in inventory values",
                             f"use one of: {', '.join(LOOKUPS)} (docs/inventory-sources.md)")
        read = _env if plugin == "env" else read_controller_file
        found = [read(host, key, t, options) for t in terms]
        # A lookup joins its results with commas; query/q returns the list (ansible.template.Templar).
        return found if many else ",".join(found)
    return lookup


def _env(host: HostVars, key: str, term: Any, options: Mapping[str, Any]) -> str:
    environ = host.resolution.environ
    if str(term) in environ:
        return environ[str(term)]
    # The env lookup's `default` option, '' unless given (ansible.builtin.env).
    default = options.get("default", "")
    if isinstance(default, jinja2.Undefined):
        raise host.error(key, f"the environment variable {term} is not set",
                         f"set {term} in the environment of ernie-deploy")
    return str(default)



def to_bool(value: Any) -> bool:
    """ansible.builtin.bool: yes/on/1/true/t (any case) are true, and their opposites false."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if value is not None else ""
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS or not text:
        return False
    raise ValueError("not a boolean (use yes/no, true/false, on/off or 1/0)")


def _mandatory(value: Any, msg: str | None = None) -> Any:
    if isinstance(value, jinja2.Undefined):
        raise jinja2.UndefinedError(msg or "a mandatory variable is not defined")
    return value


def _regex_replace(value: Any, pattern: str, replacement: str = "", ignorecase: bool = False) -> str:
    return re.sub(pattern, replacement, str(value), flags=re.IGNORECASE if ignorecase else 0)


def _regex_search(value: Any, pattern: str, ignorecase: bool = False) -> str | None:
    found = re.search(pattern, str(value), flags=re.IGNORECASE if ignorecase else 0)
    return found.group(0) if found else None


_ENV = _Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
_ANSIBLE_FILTERS: dict[str, Callable[..., Any]] = {
    "bool": to_bool,
    "ternary": lambda value, yes, no, none=None: none if value is None and none is not None else (yes if value
                                                                                                  else no),
    "mandatory": _mandatory,
    "b64encode": lambda v: base64.b64encode(str(v).encode()).decode(),
    "b64decode": lambda v: base64.b64decode(str(v)).decode(),
    "to_json": lambda v: json.dumps(v),
    "from_json": lambda v: json.loads(v),
    "regex_replace": _regex_replace,
    "regex_search": _regex_search,
    "basename": lambda v: PurePath(str(v)).name,
    "dirname": lambda v: str(PurePath(str(v)).parent),
    "split": lambda v, sep=None, maxsplit=-1: str(v).split(sep, maxsplit),
}
# Ansible's own filters offered besides Jinja's built-in ones (the names docs/inventory-sources.md lists).
ANSIBLE_FILTERS = tuple(sorted(_ANSIBLE_FILTERS))
_ENV.filters.update(_ANSIBLE_FILTERS)
