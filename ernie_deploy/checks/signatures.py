"""Fatal start-up signatures in a vLLM unit's journal (the data is signatures.yml), with cause and fix.

Pure: takes lines, returns matches. Each signature is proven on a real log excerpt in
tests/fixtures/logs/real; formats follow docs/vllm-facts.md#log-formats.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ernie_deploy.checks.result import Status
from ernie_deploy.errors import ConfigError
from ernie_deploy.planning.datafiles import bundled, load_yaml
from ernie_deploy.planning.datafiles import expect as expect_type

if TYPE_CHECKING:
    from ernie_deploy.planning.plantypes import InstancePlan

# `journalctl -o short` / `-o short-iso` put "time host ident[pid]: " before the message.
JOURNAL_PREFIX = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d{2}:?\d{2}|Z)?)"
    r" \S+ [^\s:\[]+(?:\[\d+\])?: "
)
# decorate_logs() prefixes: "(APIServer pid=1) ", "(Worker_TP1 pid=2) ", 0.9.2's "(VllmWorker rank=1 pid=2) ".
_PROC_PREFIX = re.compile(r"^\((?:[A-Za-z][\w]*(?: rank=\d+)? pid=\d+|[A-Za-z]\w* pid=\d+, ip=[\d.]+)\) ")
# vLLM's logger header "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] " (date format %m-%d %H:%M:%S).
# Before 0.8 the file:line had no opening bracket ("ERROR 04-28 15:55:45 worker_base.py:157] ").
_LOG_HEADER = re.compile(
    r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? (?:\[[^\]]*\]|[^\s\]]+:\d+\]) "
)

MAX_SPAN = 400  # lines between a traceback's first line and its exception line

# An intended stop of a run (`systemctl stop` or restart, a host shutting down): vLLM's API server logs
# `[shutdown] API server: shutdown triggered` on the SIGTERM (or SIGINT) it gets (0.32.0 and 0.34.0
# entrypoints/launchers/launcher.py), and systemd logs its stop job, `Stopping <unit> - <description>...`
# (`Stopping <description>...` before systemd 252), before it sends the signal. The stop patterns are searched in
# the whole line: systemd's own line comes without vLLM's prefixes (`-o cat`) or from `systemd[N]: `
# (journalctl's short formats), which tells it from vLLM's `INFO ... [api_router.py:54] Stopping profiler...`.
STOP_TRIGGER = re.compile(r"\[shutdown\] API server: shutdown triggered|"
                          r"(?:^|\bsystemd\[\d+\]: )Stopping \S.*(?:\.\.\.|…)$")
# Lines only a real death logs. vLLM keeps them quiet while it stops on purpose (0.32.0 v1/executor/
# multiproc_executor.py's worker monitor returns once shutting_down is set, v1/engine/core_client.py's engine
# monitor once the client is finalized), so after one of these the EngineDeadError lines are the death's.
ENGINE_DIED = re.compile(r"died unexpectedly|engine core exited unexpectedly|EngineCore encountered a fatal error")
# A new run begins: systemd starts the unit again, or vLLM's first lines (the ones logscan.last_start reads). A stop
# of an earlier run in the same lines says nothing about a later one.
RUN_BEGINS = re.compile(r"(?:^|\bsystemd\[\d+\]: )Start(?:ing \S.*(?:\.\.\.|…)|ed \S.*\.)$|"
                        r"vLLM (?:API )?server version |non-default args: \{")


def prefix_patterns() -> dict[str, str]:
    """The prefixes strip_prefix removes and the lines that tell an intended stop, as regular expressions by name
    (for the exported checker)."""
    return {"journal_prefix": JOURNAL_PREFIX.pattern, "proc_prefix": _PROC_PREFIX.pattern,
            "log_header": _LOG_HEADER.pattern, "stop_trigger": STOP_TRIGGER.pattern,
            "engine_died": ENGINE_DIED.pattern, "run_begins": RUN_BEGINS.pattern}


def strip_prefix(line: str) -> str:
    """The message part of one journal line: journal, process and logger prefixes removed, indent kept."""
    text = line.rstrip("\r\n")
    text = JOURNAL_PREFIX.sub("", text, count=1)
    text = _PROC_PREFIX.sub("", text, count=1)
    return _LOG_HEADER.sub("", text, count=1)


# ---------------------------------------------------------------------------------------------------
# Signatures


@dataclass(frozen=True)
class Signature:
    name: str
    regexes: tuple[re.Pattern[str], ...]
    cause: str
    fix: str
    after: int = 0
    severity: Status = "fail"
    generic: bool = False
    end: re.Pattern[str] | None = None
    shutdown: bool = False  # also logged by an intended stop: a match inside one is the stop's (see stopping)


@dataclass(frozen=True)
class Match:
    """One signature found in the log: the first occurrence's lines, and how often it occurred."""

    signature: str
    severity: Status
    cause: str
    fix: str
    lines: tuple[str, ...]  # the matching line, then context (for tracebacks: the last lines up to the exception)
    line_no: int  # 0-based index of the matching line in the input
    headline: str  # the key message without prefixes (a traceback's exception line)
    count: int = 1


class _Blank(dict[str, str]):
    """Formatting values where a placeholder nobody can fill prints as <name> instead of raising."""

    def __missing__(self, key: str) -> str:
        return f"<{key}>"


def _fill(template: str, values: Mapping[str, Any]) -> str:
    return string.Formatter().vformat(template, (), _Blank({k: as_text(v) for k, v in values.items() if v is not None}))


def as_text(value: Any) -> str:
    """A plan value as messages and patterns show it: a GPU list as `0,1`."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(str(v) for v in value)
    return str(value)


def _compile(pattern: Any, where: str, key: str) -> re.Pattern[str]:
    expect_type(pattern, str, where, key)
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"{key}: invalid regular expression {pattern!r}: {exc.msg}", where=where) from exc


def parse_signatures(raw: Any, where: str) -> tuple[Signature, ...]:
    """Validate the YAML document of signatures.yml (a mapping with a `signatures` list)."""
    items = expect_type(expect_type(raw, dict, where, "(top)").get("signatures"), list, where, "signatures")
    out: list[Signature] = []
    for n, item in enumerate(items):
        key = f"signatures[{n}]"
        expect_type(item, dict, where, key)
        unknown = set(item) - {"name", "regex", "cause", "fix", "after", "severity", "generic", "end", "shutdown"}
        if unknown:
            raise ConfigError(f"{key}: unknown key(s) {', '.join(sorted(unknown))}", where=where)
        name = expect_type(item.get("name"), str, where, f"{key}.name")
        rx = item.get("regex")
        patterns = rx if isinstance(rx, list) else [rx]
        severity = item.get("severity", "fail")
        if severity not in ("fail", "warn"):
            raise ConfigError(f"{key}.severity: expected fail or warn, got {severity!r}", where=where)
        for text_key in ("cause", "fix"):
            template = expect_type(item.get(text_key), str, where, f"{key}.{text_key}")
            try:
                _fill(template, {})
            except (ValueError, IndexError) as exc:
                raise ConfigError(f"{key}.{text_key}: bad placeholder in {template!r}: {exc}", where=where) from exc
        end = item.get("end")
        out.append(Signature(
            name=name,
            regexes=tuple(_compile(p, where, f"{key}.regex") for p in patterns),
            cause=item["cause"],
            fix=item["fix"],
            after=expect_type(item.get("after", 0), int, where, f"{key}.after"),
            severity=severity,
            generic=expect_type(item.get("generic", False), bool, where, f"{key}.generic"),
            end=None if end is None else _compile(end, where, f"{key}.end"),
            shutdown=expect_type(item.get("shutdown", False), bool, where, f"{key}.shutdown"),
        ))
    return tuple(out)


@functools.cache
def _bundled_signatures() -> tuple[Signature, ...]:
    path = bundled("signatures.yml")
    return parse_signatures(load_yaml(path), str(path))


def load_signatures(path: Path | None = None) -> tuple[Signature, ...]:
    """The shipped signatures, or a user's own file in the same format."""
    if path is None:
        return _bundled_signatures()
    return parse_signatures(load_yaml(path), str(path))


def _valid_tp(heads: int) -> str:
    return ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)


def _values(groups: Mapping[str, str | None], context: Mapping[str, Any]) -> dict[str, Any]:
    """Placeholder values: the plan's context, then what the log line itself says (the log wins)."""
    values: dict[str, Any] = dict(context)
    values.update({k: v for k, v in groups.items() if v is not None})
    heads = values.get("heads") or values.get("num_attention_heads")
    if heads is not None and str(heads).isdigit() and "valid_tp" not in context:
        values["valid_tp"] = _valid_tp(int(heads))
    return values


def stopping(lines: Sequence[str]) -> list[bool]:
    """Per line: whether its run is being stopped on purpose with its engine still alive: an intended stop began
    earlier in the run (STOP_TRIGGER) and no death line (ENGINE_DIED) came yet, up to and including this line.

    Such a stop aborts the requests in flight, and vLLM logs each as an `EngineDeadError` traceback at ERROR
    (real 0.32.0, tests/fixtures/logs/real/stop-abort-0.32.log): that is the shutdown, not a crash. A death line
    before or during the stop keeps its tracebacks a failure."""
    out: list[bool] = []
    stopped = died = False
    for line in lines:
        if RUN_BEGINS.search(line):
            stopped = died = False
        died = died or bool(ENGINE_DIED.search(line))
        stopped = stopped or bool(STOP_TRIGGER.search(line))
        out.append(stopped and not died)
    return out


@dataclass(frozen=True)
class Stop:
    """The intended stop of the last run in a log."""

    line: str  # the line that began it
    headline: str  # that line without prefixes
    quiet: tuple[str, ...]  # `shutdown` signatures whose lines the stop itself logged, not failures


def intended_stop(lines: Iterable[str], signatures: Sequence[Signature] | None = None) -> Stop | None:
    """The intended stop of the last run in `lines` (see stopping), or None when that run was not stopped so."""
    raw = [line.rstrip("\r\n") for line in lines]
    begins = max((i for i, line in enumerate(raw) if RUN_BEGINS.search(line)), default=0)
    at = next((i for i in range(begins, len(raw)) if STOP_TRIGGER.search(raw[i])), None)
    if at is None:
        return None
    quiet = stopping(raw)
    msgs = [strip_prefix(line) for line in raw]
    sigs = signatures if signatures is not None else load_signatures()
    names = tuple(s.name for s in sigs if s.shutdown and any(
        quiet[i] and any(rx.search(msgs[i]) for rx in s.regexes) for i in range(at, len(raw))))
    return Stop(raw[at], msgs[at].strip(), names)


def _find(sig: Signature, msgs: Sequence[str], start: int,
          quiet: Sequence[bool]) -> tuple[int, int, re.Match[str]] | None:
    """First (line, end line, match) at or after `start`; end line == line unless the signature spans. A match of
    a `shutdown` signature whose lines lie in an intended stop (`quiet`, see stopping) is the stop's: skipped."""
    for i in range(start, len(msgs)):
        found = next((m for rx in sig.regexes if (m := rx.search(msgs[i]))), None)
        if found is None:
            continue
        end = sig.end
        j = i if end is None else next((k for k in range(i + 1, min(len(msgs), i + 1 + MAX_SPAN))
                                        if end.search(msgs[k])), None)
        if j is None or (sig.shutdown and quiet[i] and quiet[j]):
            continue
        return i, j, found
    return None


def scan(
    lines: Iterable[str],
    context: Mapping[str, Any] | None = None,
    signatures: Sequence[Signature] | None = None,
) -> list[Match]:
    """Every signature found in `lines`, in the order of first appearance.

    A generic signature (a bare traceback) is dropped when a specific failure explains the same log: the
    final `RuntimeError: Engine core initialization failed` follows every root cause and adds nothing. The
    lines an intended stop logs as it shuts the engine down are not failures (see stopping).
    """
    raw = [line.rstrip("\r\n") for line in lines]
    msgs = [strip_prefix(line) for line in raw]
    quiet = stopping(raw)
    ctx = dict(context or {})
    found: list[Match] = []
    for sig in signatures if signatures is not None else load_signatures():
        first = _find(sig, msgs, 0, quiet)
        if first is None:
            continue
        i, j, m = first
        count, nxt = 1, _find(sig, msgs, j + 1, quiet)
        while nxt is not None:
            count, nxt = count + 1, _find(sig, msgs, nxt[1] + 1, quiet)
        if sig.end is None:
            evidence = raw[i : i + 1 + sig.after]
            headline = msgs[i].strip()
        else:
            # The first line shows where it started; the last lines carry the exception. Indented lines right
            # after the exception belong to it (pydantic's "  Value error, ...").
            tail_end = j + 1
            while tail_end < len(msgs) and tail_end <= j + 2 and msgs[tail_end][:1].isspace():
                tail_end += 1
            evidence = [raw[i], *raw[max(i + 1, j + 1 - sig.after) : tail_end]]
            headline = msgs[j].strip()
        values = _values({**m.groupdict(), "exception": headline if sig.end else None}, ctx)
        found.append(Match(sig.name, sig.severity, _fill(sig.cause, values), _fill(sig.fix, values),
                           tuple(evidence), i, headline, count))
    if any(not _generic(m.signature, signatures) and m.severity == "fail" for m in found):
        found = [m for m in found if not _generic(m.signature, signatures)]
    return sorted(found, key=lambda m: m.line_no)


def _generic(name: str, signatures: Sequence[Signature] | None) -> bool:
    sigs = signatures if signatures is not None else load_signatures()
    return any(s.generic for s in sigs if s.name == name)


CONTEXT_KEYS = ("unit", "port", "gpus", "served_model_name", "tensor_parallel_size", "max_model_len",
                "gpu_memory_utilization", "num_attention_heads")


def instance_context(instance: InstancePlan, num_attention_heads: int | None = None) -> dict[str, Any]:
    """The plan values a signature's fix may name, for one instance."""
    return {
        "unit": f"{instance.unit}.service",
        "port": instance.port,
        "gpus": instance.gpus,
        "served_model_name": instance.served_model_name,
        "tensor_parallel_size": instance.tensor_parallel_size,
        "max_model_len": instance.max_model_len,
        "gpu_memory_utilization": instance.gpu_memory_utilization,
        "num_attention_heads": num_attention_heads,
    }
