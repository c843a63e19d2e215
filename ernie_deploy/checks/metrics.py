"""vLLM's /metrics during a drain: how many requests the engine still has.

`vllm:num_requests_running` ("Number of requests in model execution batches.") and
`vllm:num_requests_waiting` ("Number of requests waiting to be processed.") are gauges labelled by
model_name and engine (vllm 0.18.0 and 0.34.0 `v1/metrics/loggers.py`). They count scheduler state, so they
are read after the load balancer stopped sending, before SIGTERM (docs/rolling.md).
"""

from __future__ import annotations

import re

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def in_flight(text: str) -> int | None:
    """Running + waiting requests summed over every engine and model, or None when neither gauge is exported
    (not a vLLM /metrics page: the caller must not read that as idle)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] not in GAUGES:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        seen = True
        total += value
    return round(total) if seen else None
