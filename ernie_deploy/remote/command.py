"""Typed remote commands: what the orchestration asks a host to do, as a value.

A command is an operation name plus the shell script that performs it (and its stdin, which carries any
data and secrets: never the command line; file copies stream after it). Transports run the script; a
scripted fake transport in the tests answers by the operation, so flows are tested on what they mean, not on
display labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class Op(Enum):
    FACTS = "gather facts"
    LOCK_FACTS = "lock + gather facts"
    RELEASE_LOCK = "release lock"
    SHOW_LOCK = "show lock"
    BREAK_LOCK = "break lock"
    READ_FILES = "read files"
    STAGE = "stage files"
    ACTIVATE = "activate units"
    PROBE = "probe instances"
    WATCH = "watch instance"
    RELEASES = "list releases"
    RESTORE = "restore release"
    STOP = "stop unit"
    GPU_RELEASE = "read GPU release"
    UNDO = "undo a failed start"
    METRICS = "read metrics"
    PROVISION_PROBE = "lock + provisioning facts"
    CREATE_USER = "create service user"
    OS_PACKAGES = "install OS packages"
    INSTALL_VLLM = "install vLLM"
    PRUNE_VENVS = "remove old vLLM venvs"
    HASH_FILES = "hash files"
    RECEIVE = "receive file"
    SWITCH = "switch in files"
    HUB_DOWNLOAD = "download from the Hub"
    COMMAND = "operator command"  # a playbook's `command` task
    LOGS = "read journal"
    SCRIPT = "script"  # an ad-hoc script (tests, the lab): no orchestration flow sends one


@dataclass(frozen=True)
class Command:
    op: Op
    script: str
    stdin: bytes = b""
    timeout: float = 120.0
    check: bool = True  # a non-zero exit raises RemoteError
    units: tuple[str, ...] = ()  # the units the command is about (activate, watch, probe)
    # Bytes streamed to the script's stdin after `stdin` (file copies): produced while sending, so a large
    # file is never held in memory, and a stream that stops early ends the script's input there.
    stream: Iterable[bytes] | None = None

    @property
    def label(self) -> str:
        return self.op.value + (f" {' '.join(self.units)}" if self.units and self.op is Op.WATCH else "")


def script(text: str, *, stdin: bytes = b"", check: bool = True, timeout: float = 120.0) -> Command:
    return Command(Op.SCRIPT, text, stdin=stdin, check=check, timeout=timeout)
