"""Building a fleet's worth of long-lived objects without CPython's collector re-scanning them."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while loading, planning or rendering many hosts.

    Those steps allocate millions of objects that all stay alive, and every automatic full collection
    re-scans each of them, so the run grew faster than the host count (bench/plan_render.py at 100,000
    hosts: 10.8 s of 33 s were spent in the collector). Reference counting still frees ordinary garbage
    while paused; cycles wait for the first collection after resuming. A collector that was already off
    stays off.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
