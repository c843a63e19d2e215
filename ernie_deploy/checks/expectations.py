"""What a playbook's `verify` tasks add to the checks: extra log patterns, and a streamed smoke completion.

Patterns are regular expressions; `{name}` placeholders take the instance's planned values
(tensor_parallel_size, max_model_len, served_model_name, port, unit, gpu_memory_utilization).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Expectations:
    expect: Sequence[str] = ()  # must appear in the start-up log
    forbid: Sequence[str] = ()  # must not appear
    stream: bool = False  # the smoke completion streams (server-sent events), as chat front ends ask

    def merged(self, other: Expectations) -> Expectations:
        return Expectations(tuple(self.expect) + tuple(other.expect), tuple(self.forbid) + tuple(other.forbid),
                            self.stream or other.stream)
