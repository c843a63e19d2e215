"""vLLM's /metrics during a drain: how many requests the engine still has.

`vllm:num_requests_running` ("Number of requests in model execution batches.") and
`vllm:num_requests_waiting` ("Number of requests waiting to be processed.") are gauges labelled by
model_name and engine (vllm 0.18.0 and 0.34.0 `v1/metrics/loggers.py`). They count scheduler state, so they
are read after the load balancer stopped sending, before SIGTERM (docs/rolling.md).

The page is Prometheus's text format (prometheus.io/docs/instrumenting/exposition_formats, "Text format
details"): `name{label="value",...} value [timestamp]`, where a label value may hold any character, with
backslash, double quote and line feed written `\\`, `\"` and `\n`. So a served model name with `}` or `"`
in it is one label value, not the end of the labels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# A label: name="value", the value a run of non-quote non-backslash characters or escapes (so `\"` and `}`
# stay inside it).
_PAIR = r'([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"'
_PAIRS = rf"[ \t]*(?:{_PAIR}[ \t]*,[ \t]*)*(?:{_PAIR}[ \t]*)?"
_SAMPLE = re.compile(rf"(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{{(?P<labels>{_PAIRS})\}})?[ \t]+(?P<value>\S+)")
_ESCAPE = re.compile(r'\\[\\"n]')
_UNESCAPED = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]  # unescaped values
    value: float


def parse_sample(line: str) -> Sample | None:
    """One sample line, or None for comments, blank and malformed lines."""
    m = _SAMPLE.match(line)
    if m is None:
        return None
    try:
        value = float(m["value"])
    except ValueError:
        return None
    # The block matched as a whole, so its pairs, found left to right, are exactly its labels.
    pairs = re.findall(_PAIR, m["labels"] or "")
    labels = {k: _ESCAPE.sub(lambda e: _UNESCAPED[e.group()], v) for k, v in pairs}
    return Sample(m["name"], labels, value)


def in_flight(text: str) -> int | None:
    """Running + waiting requests summed over every engine and model, or None when neither gauge is exported
    (not a vLLM /metrics page: the caller must not read that as idle)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        sample = parse_sample(line)
        if sample is None or sample.name not in GAUGES:
            continue
        seen = True
        total += sample.value
    return round(total) if seen else None
