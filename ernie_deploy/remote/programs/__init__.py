"""The programs ernie-deploy runs on hosts with the host's own python3, kept as real files so ruff and mypy read
them, and sent as text (`python3 -c PROGRAM`): the host has no ernie-deploy installed.

They use the standard library only and stay runnable by an old python3 (3.6: no annotations that need a newer
one at run time, no newer syntax), since the host's python3 is not the controller's. A program may import a
pure function of ernie_deploy (`from ernie_deploy.planning.hostpaths import local_url`): the text sent carries
that function's source in place of the import, so host and controller apply the same rule.
"""

from __future__ import annotations

import importlib
import inspect
import re
from importlib import resources
from types import ModuleType

_IMPORT = re.compile(r"^from (ernie_deploy(?:\.\w+)+) import (\w+(?:, \w+)*)\n", re.MULTILINE)


def _functions(module: ModuleType, name: str, seen: dict[str, str], calling: tuple[str, ...] = ()) -> None:
    """`name`'s source after that of the module's functions it calls (a function is defined before its use)."""
    fn = getattr(module, name)
    for used in fn.__code__.co_names:
        if used not in seen and used not in calling and inspect.isfunction(getattr(module, used, None)):
            _functions(module, used, seen, (*calling, name))
    seen.setdefault(name, inspect.getsource(fn))


def _inline(found: re.Match[str]) -> str:
    module = importlib.import_module(found.group(1))
    seen: dict[str, str] = {}
    for name in found.group(2).split(", "):
        _functions(module, name, seen)
    return "\n\n".join(seen.values()) + "\n"


def program(name: str) -> str:
    """The text of program `name` (a file beside this one) as it is sent to a host."""
    return _IMPORT.sub(_inline, (resources.files(__package__) / f"{name}.py").read_text(encoding="utf-8"))
