"""Keyword checks on a vLLM unit's start-up log: the TP and context length it really uses, the KV capacity
it reports, playbook expect/forbid patterns, and no fatal signatures (see signatures.py).

Pure: takes lines, returns values. Formats follow docs/vllm-facts.md#log-formats; the guide's
`Using tensor parallel size N` line does not exist in real vLLM, so the engine-config line is the primary
evidence and the guide's form is only accepted if present.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ernie_deploy.checks.result import CheckResult, Status
from ernie_deploy.checks.signatures import (
    CONTEXT_KEYS,
    JOURNAL_PREFIX,
    as_text,
    intended_stop,
    prefix_patterns,
    scan,
    strip_prefix,
)
from ernie_deploy.errors import ConfigError

_START = re.compile(r"^(?:vLLM API server version |vLLM server version )")
_NON_DEFAULT = re.compile(r"^non-default args: (?P<args>\{.*\})")
_ENGINE = re.compile(r"^Initializing an? (?:V1 )?LLM engine \(v[^)]*\) with config: (?P<config>.*)")
_CFG_TP = re.compile(r"\btensor_parallel_size=(\d+)")
_CFG_LEN = re.compile(r"\bmax_seq_len=(\d+)")
_ARG_TP = re.compile(r"'tensor_parallel_size': (\d+)")
_USING_TP = re.compile(r"Using tensor parallel size (\d+)")
_USING_LEN = re.compile(r"^Using max model len (\d+)")
_WORKER = re.compile(
    r"^\((?:Worker(?:_DP\d+)?(?:_PP\d+)?_TP(?P<tp>\d+)(?:_EP\d+)?|VllmWorker rank=(?P<rank>\d+)) pid=\d+\)"
)
# initialize_model_parallel's rank line: 0.11.0 `rank %s in world size %s is assigned as DP rank %s, PP rank %s,
# TP rank %s, EP rank %s`; 0.34.0 adds `PCP rank %s, ` before the TP rank (vllm/distributed/parallel_state.py).
_RANK = re.compile(r"^rank \d+ in world size \d+ is assigned as DP rank \d+, PP rank \d+, (?:PCP rank \d+, )?"
                   r"TP rank (?P<tp>\d+)\b")
# The pool the line names: GPU, or CPU on vLLM's CPU backend (0.32.0 vllm/v1/core/kv_cache_utils.py:2311-2313).
_KV_SIZE = re.compile(r"(?:\b(?P<device>[A-Z]+) )?KV cache size: (?P<tokens>[\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<x>[\d.]+)x")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def last_start(lines: Sequence[str]) -> int:
    """Index where the last vLLM start-up begins (its version banner), 0 when none is in view.

    A journal window may hold an earlier run (a restart loop, a previous deploy); the keyword checks must
    judge the run that is up now, not a mix.
    """
    starts = [i for i, line in enumerate(lines) if _START.search(strip_prefix(line))]
    if starts:
        return starts[-1]
    args = [i for i, line in enumerate(lines) if _NON_DEFAULT.search(strip_prefix(line))]
    return args[-1] if args else 0


def _last(lines: Sequence[str], rx: re.Pattern[str]) -> tuple[re.Match[str], str] | None:
    for line in reversed(lines):
        m = rx.search(strip_prefix(line))
        if m:
            return m, line.rstrip("\r\n")
    return None


def _tp_evidence(seg: Sequence[str]) -> list[tuple[str, int, str]]:
    """(source, TP, line) from each kind of line that states the TP size, strongest first."""
    out: list[tuple[str, int, str]] = []
    engine = _last(seg, _ENGINE)
    if engine and (m := _CFG_TP.search(engine[0]["config"])):
        out.append(("engine config", int(m.group(1)), engine[1]))
    args = _last(seg, _NON_DEFAULT)
    if args:
        # Absent from non-default args means vLLM's default, 1.
        m = _ARG_TP.search(args[0]["args"])
        out.append(("non-default args", int(m.group(1)) if m else 1, args[1]))
    using = _last(seg, _USING_TP)
    if using:
        out.append(("'Using tensor parallel size'", int(using[0].group(1)), using[1]))
    return out


def _workers(seg: Sequence[str]) -> dict[int, str]:
    """First line of each distinct TP worker rank (V1 `Worker_TPk`, 0.9.2 `VllmWorker rank=k`).

    Without any worker process prefix (a single-GPU EngineCore, or a log format without vLLM's prefix), the
    rank lines' `TP rank k` say which ranks started instead."""
    ranks: dict[int, str] = {}
    stated: dict[int, str] = {}
    for raw in seg:
        line = raw.rstrip("\r\n")
        m = _WORKER.match(JOURNAL_PREFIX.sub("", line, count=1))
        if m:
            rank = int(m.group("tp") if m.group("tp") is not None else m.group("rank"))
            ranks.setdefault(rank, line)
        elif r := _RANK.match(strip_prefix(line)):
            stated.setdefault(int(r.group("tp")), line)
    return ranks or stated


def _check_tp(seg: Sequence[str], tp: int, instance: str | None) -> CheckResult:
    name = "tensor_parallel"
    evidence = _tp_evidence(seg)
    workers = _workers(seg)
    worker_lines = tuple(workers[r] for r in sorted(workers))
    if not evidence:
        return CheckResult(name, "warn", f"no start-up line states the tensor parallel size (plan: TP {tp})",
                           worker_lines, cause="the log has no engine-config or non-default-args line",
                           fix="pass the unit's journal from its last start", instance=instance)
    wrong = [(src, n, line) for src, n, line in evidence if n != tp]
    if wrong:
        src, n, line = wrong[0]
        return CheckResult(name, "fail", f"plan says TP {tp}, vLLM uses TP {n} ({src} line: {line})",
                           tuple(e[2] for e in evidence), cause=f"the running vLLM was started with TP {n}",
                           fix="re-render and restart the unit so ExecStart carries --tensor-parallel-size "
                               f"{tp}", instance=instance)
    quoted = (evidence[0][2], *worker_lines)
    if tp > 1 and workers and len(workers) != tp:
        found = ", ".join(f"Worker_TP{r}" for r in sorted(workers))
        return CheckResult(name, "fail", f"plan says TP {tp}, but the log shows {len(workers)} TP worker "
                           f"process(es): {found}", quoted, cause="not every tensor-parallel worker started",
                           fix="read the worker's error lines in the journal (NCCL, CUDA) and restart the unit",
                           instance=instance)
    if tp > 1 and not workers:
        return CheckResult(name, "warn", f"Using tensor parallel size {tp}, but no Worker_TP lines to cross-check "
                           f"({_stated(evidence)})", quoted, instance=instance)
    if tp == 1 and len(workers) > 1:
        return CheckResult(name, "fail", f"plan says TP 1, but the log shows {len(workers)} TP workers", quoted,
                           instance=instance)
    # vLLM never prints "Using tensor parallel size N": the phrase is ours (operators search for it), so the
    # summary always carries the evidence it stands on.
    prefixed = all(_WORKER.match(JOURNAL_PREFIX.sub("", line, count=1)) for line in worker_lines)
    label = "Worker_TP" if prefixed else "TP rank "
    ranks = f"; {', '.join(f'{label}{r}' for r in sorted(workers))} started" if workers else ""
    return CheckResult(name, "pass", f"Using tensor parallel size {tp} ✓ ({_stated(evidence)}{ranks})", quoted,
                       instance=instance)


def _stated(evidence: Sequence[tuple[str, int, str]]) -> str:
    """Where the TP size was read: `tensor_parallel_size=N` from vLLM's engine-config line, or the weaker ones."""
    source, n, _ = evidence[0]
    if source == "engine config":
        return f"vLLM's engine config says tensor_parallel_size={n}"
    return f"vLLM's {source} say TP {n}" if source == "non-default args" else f"the log says TP {n}"


def _check_len(seg: Sequence[str], max_model_len: int | None, instance: str | None) -> CheckResult:
    name = "max_model_len"
    seen: list[tuple[int, str]] = []
    if (using := _last(seg, _USING_LEN)) is not None:
        seen.append((int(using[0].group(1)), using[1]))
    engine = _last(seg, _ENGINE)
    if engine and (m := _CFG_LEN.search(engine[0]["config"])):
        seen.append((int(m.group(1)), engine[1]))
    if not seen:
        return CheckResult(name, "warn", "no 'Using max model len' or max_seq_len= line in the start-up log",
                           instance=instance)
    lines = tuple(dict.fromkeys(line for _, line in seen))
    if max_model_len is None:
        return CheckResult(name, "pass", f"max model len {seen[0][0]} (derived by vLLM; the plan leaves it unset)",
                           lines, instance=instance)
    wrong = [(n, line) for n, line in seen if n != max_model_len]
    if wrong:
        return CheckResult(name, "fail", f"plan says max_model_len {max_model_len}, vLLM uses {wrong[0][0]} "
                           f"(line: {wrong[0][1]})", lines, cause="the unit runs with another --max-model-len",
                           fix=f"re-render and restart the unit with --max-model-len {max_model_len}",
                           instance=instance)
    return CheckResult(name, "pass", f"Using max model len {max_model_len} ✓", lines, instance=instance)


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _check_kv(seg: Sequence[str], estimate: int | None, tolerance: float, instance: str | None) -> CheckResult:
    name = "kv_cache"
    size = _last(seg, _KV_SIZE)
    if size is None:
        return CheckResult(name, "warn", "no 'GPU KV cache size' line: the engine has not finished start-up",
                           instance=instance)
    tokens = _number(size[0]["tokens"])
    said = f"{size[0]['device']} KV cache size" if size[0]["device"] else "KV cache size"
    lines = [size[1]]
    conc = _last(seg, _CONCURRENCY)
    extra = ""
    if conc is not None:
        extra = f", maximum concurrency {conc[0]['x']}x at {_number(conc[0]['len']):,} tokens per request"
        if conc[1] not in lines:
            lines.append(conc[1])
    if not estimate:
        return CheckResult(name, "pass", f"{said} {tokens:,} tokens{extra} (no planner estimate)",
                           tuple(lines), instance=instance)
    off = (tokens - estimate) / estimate
    if abs(off) > tolerance:
        return CheckResult(name, "warn", f"{said} {tokens:,} tokens, planner estimated {estimate:,} "
                           f"({off:+.0%}, tolerance ±{tolerance:.0%}){extra}", tuple(lines),
                           cause="the planner's memory model differs from what vLLM profiled on this host "
                                 "(other processes on the GPU, version-specific activation or CUDA-graph memory)",
                           fix="trust vLLM's number; if capacity matters, adjust gpu_memory_utilization or the "
                               "planner's reserves", instance=instance)
    return CheckResult(name, "pass", f"{said} {tokens:,} tokens (planner: {estimate:,}, {off:+.0%}){extra}",
                       tuple(lines), instance=instance)


def _pattern(kind: str, pattern: str, values: Mapping[str, Any]) -> re.Pattern[str]:
    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key in values:
            return re.escape(as_text(values[key]))
        if key.isdigit():  # a regex quantifier such as \d{4}
            return m.group(0)
        known = ", ".join(sorted(values)) or "none"
        raise ConfigError(f"{kind} pattern {pattern!r}: unknown placeholder {{{key}}} (known: {known})",
                          where=f"{kind}: {pattern}")

    text = _PLACEHOLDER.sub(sub, pattern)
    try:
        return re.compile(text)
    except re.error as exc:
        raise ConfigError(f"{kind} pattern {pattern!r} is not a valid regular expression: {exc.msg}",
                          where=f"{kind}: {pattern}", hint="escape literal ( ) [ ] . with a backslash") from exc


def check_pattern(kind: str, pattern: str) -> ConfigError | None:
    """The error a playbook pattern would raise when a check runs (unknown placeholder, bad regex), or None.

    Placeholders get a stand-in value so the check needs no plan: run it when the playbook is loaded."""
    try:
        _pattern(kind, pattern, dict.fromkeys(CONTEXT_KEYS, "0"))
    except ConfigError as exc:
        return exc
    return None


def _search(rx: re.Pattern[str], lines: Sequence[str]) -> str | None:
    for line in lines:
        if rx.search(strip_prefix(line)) or rx.search(line):
            return line.rstrip("\r\n")
    return None


def _check_fatal(lines: Sequence[str], context: Mapping[str, Any], instance: str | None) -> CheckResult:
    name = "startup_errors"
    matches = scan(lines, context)
    if not matches:
        stop = intended_stop(lines)
        if stop is None or not stop.quiet:
            return CheckResult(name, "pass", "no fatal start-up errors in the log", instance=instance)
        # Say why the error lines someone reading the journal will see do not count.
        return CheckResult(name, "pass", f"no fatal start-up errors in the log; the run was stopped on request "
                           f"({stop.headline}), and its {', '.join(stop.quiet)} lines are that stop's shutdown, "
                           "not a crash", (stop.line,), instance=instance)
    top = next((m for m in matches if m.severity == "fail"), matches[0])
    others = [m.signature for m in matches if m is not top]
    more = f" (also: {', '.join(others)})" if others else ""
    evidence = tuple(line for m in matches for line in m.lines)
    status: Status = "fail" if any(m.severity == "fail" for m in matches) else "warn"
    return CheckResult(name, status, f"{top.signature}: {top.headline}{more}", evidence, top.cause, top.fix, instance)


def check_startup_log(
    lines: Iterable[str],
    *,
    tp: int,
    max_model_len: int | None,
    kv_tokens_estimate: int | None,
    tolerance: float = 0.25,
    expect: Sequence[str] = (),
    forbid: Sequence[str] = (),
    values: Mapping[str, Any] | None = None,
    context: Mapping[str, Any] | None = None,
    instance: str | None = None,
) -> list[CheckResult]:
    """Judge one instance's journal since its restart against its plan.

    The keyword checks read the last start-up in view (see last_start); the fatal-signature check reads
    every line, because a crash and restart inside the window is itself a finding. `values` fill `{name}`
    placeholders in expect/forbid patterns (escaped as literals); `context` fills signature fixes.
    """
    all_lines = [line.rstrip("\r\n") for line in lines]
    seg = all_lines[last_start(all_lines):]
    vals = dict(values or {})
    ctx = {"tensor_parallel_size": tp, "max_model_len": max_model_len, **(context or {})}
    # Compile every playbook pattern first, so one bad pattern fails the whole call before any verdict.
    expects = [(p, _pattern("expect", p, vals)) for p in expect]
    forbids = [(p, _pattern("forbid", p, vals)) for p in forbid]
    results = [_check_tp(seg, tp, instance), _check_len(seg, max_model_len, instance),
               _check_kv(seg, kv_tokens_estimate, tolerance, instance)]
    for pattern, rx in expects:
        hit = _search(rx, seg)
        results.append(CheckResult(f"expect {pattern}", "pass" if hit else "fail",
                                   f"found /{rx.pattern}/" if hit else f"missing /{rx.pattern}/ in the start-up log",
                                   (hit,) if hit else (), instance=instance))
    for pattern, rx in forbids:
        hit = _search(rx, seg)
        results.append(CheckResult(f"forbid {pattern}", "fail" if hit else "pass",
                                   f"forbidden /{rx.pattern}/ found" if hit else f"no /{rx.pattern}/",
                                   (hit,) if hit else (), instance=instance))
    results.append(_check_fatal(all_lines, ctx, instance))
    return results


def patterns() -> dict[str, str]:
    """The regular expressions these checks read a start-up log with, by name: the exported Ansible role's
    checker (export/hostscript.py) is given exactly these, so the two can only disagree in logic, which
    tests/test_export_checker.py compares on the log fixtures."""
    return {
        "start": _START.pattern, "non_default": _NON_DEFAULT.pattern, "engine": _ENGINE.pattern,
        "cfg_tp": _CFG_TP.pattern, "arg_tp": _ARG_TP.pattern, "using_tp": _USING_TP.pattern,
        "worker": _WORKER.pattern, "rank": _RANK.pattern, **prefix_patterns(),
    }
