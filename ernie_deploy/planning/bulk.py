"""Building a fleet's worth of long-lived objects without CPython's collector re-scanning them."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # pauses in progress, in any thread
_resume = False  # whether the collector was on when the first of them began


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while loading, planning or rendering many hosts.

    Those steps allocate millions of objects that all stay alive, and every automatic full collection
    re-scans each of them, so the run grew faster than the host count (bench/plan_render.py at 100,000
    hosts: 10.8 s of 33 s were spent in the collector). Reference counting still frees ordinary garbage
    while paused; cycles wait for the first collection after resuming. Pauses nest and may overlap across
    threads: the collector comes back when the last one ends, and only if it was on before the first.
    """
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
