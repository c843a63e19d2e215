"""The simulated vLLM's latency model: how long a completion takes, given the instance and the load.

These are the simulator's own numbers, chosen so SLO gates and calibration have a shape to decide on and a lab
bench stays quick; they are not measurements of any GPU. With `tp` the instance's tensor-parallel size,
`running` the requests the engine runs at once (this one included), `scale` the faults.json knob
`latency_scale` (default 1) and `j` a jitter factor in [1 - JITTER, 1 + JITTER] drawn from a hash of the request
(so the same prompt on the same load takes the same time):

    speedup(tp) = (2 * TP_EFFICIENCY) ** log2(tp)            each doubling of TP is worth 1.6x, not 2x
    TTFT        = scale * j * (OVERHEAD + input_tokens * PREFILL_PER_TOKEN / speedup(tp))
                        * (1 + PREFILL_CONTENTION * (running - 1))
    TPOT        = scale * j * DECODE_PER_TOKEN / speedup(tp) * (1 + DECODE_CONTENTION * (running - 1))

so time to first token grows with the input and with the batch (prefill shares the GPU with the running
decodes), the time per output token shrinks with TP (less than linearly) and grows slowly with the batch
(decode is memory-bound). Time spent waiting for a `--max-num-seqs` slot comes on top of the TTFT, as in vLLM.
The faults.json knob `token_seconds` still pins the time per output token to an exact value (no TP, batch or
jitter), as it always did. Pipeline parallelism is not modelled (it adds no per-token speed at batch 1).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

OVERHEAD = 0.010  # seconds per request: HTTP, tokenisation, scheduling
PREFILL_PER_TOKEN = 0.0001  # seconds per input token at TP 1
DECODE_PER_TOKEN = 0.004  # seconds per output token at TP 1, batch 1
PREFILL_CONTENTION = 0.15  # TTFT grows by this fraction per other running request
DECODE_CONTENTION = 0.04  # TPOT grows by this fraction per other running request
TP_EFFICIENCY = 0.8  # fraction of the ideal 2x that one doubling of TP buys
JITTER = 0.1  # +/- this fraction, deterministic per request and token


def unit(key: str) -> float:
    """A number in [0, 1) fixed by `key` (the jitter's source: reproducible, no global random state)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


@dataclass(frozen=True)
class LatencyModel:
    """The model for one instance (see the module docstring for the formula)."""

    tp: int = 1
    scale: float = 1.0
    token_seconds: float | None = None  # faults.json `token_seconds`: exact time per output token

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {self.tp}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"latency_scale must be a number > 0, got {self.scale!r}")
        if self.token_seconds is not None and not (math.isfinite(self.token_seconds) and self.token_seconds >= 0):
            raise ValueError(f"token_seconds must be a number >= 0, got {self.token_seconds!r}")

    def speedup(self) -> float:
        return float((2 * TP_EFFICIENCY) ** math.log2(self.tp))

    def _jitter(self, key: str) -> float:
        return 1 + JITTER * (2 * unit(key) - 1)

    def ttft(self, input_tokens: int, running: int, key: str) -> float:
        """Prefill time of a request admitted with `running` requests in the engine (itself included)."""
        base = OVERHEAD + max(0, input_tokens) * PREFILL_PER_TOKEN / self.speedup()
        return self.scale * self._jitter(f"ttft:{key}") * base * (1 + PREFILL_CONTENTION * max(0, running - 1))

    def tpot(self, running: int, key: str, index: int) -> float:
        """Time to produce output token `index` (1-based after the first) while `running` requests decode."""
        if self.token_seconds is not None:
            return self.token_seconds
        base = DECODE_PER_TOKEN / self.speedup()
        return self.scale * self._jitter(f"tpot:{key}:{index}") * base * (1 + DECODE_CONTENTION * max(0, running - 1))
