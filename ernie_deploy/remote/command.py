"""Typed remote commands: what the orchestration asks a host to do, as a value.

A command is an intent (what it means: stage these files, undo these units, take this lock) plus how it
travels: its stdin, which carries any data and secrets (never the command line; file copies stream after it),
its timeout and whether a failure raises. The shell script is rendered from the intent, so what a command
says it does and what the host runs cannot disagree. Transports run the script; a scripted fake transport in
the tests answers from the intent, so flows are tested on what they mean, not on shell text or display labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol


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
    BALANCER_APPLY = "apply balancer config"
    BALANCER_ADMIN = "balancer runtime API"
    BENCH = "vllm bench serve"
    SCRIPT = "script"  # an ad-hoc script (tests, the lab): no orchestration flow sends one


class Intent(Protocol):
    """What a command means. Each kind is a small frozen dataclass beside its builder in remote/, naming its
    operation (`op`, mostly a class constant) and rendering its own shell script."""

    @property
    def op(self) -> Op: ...

    def render(self) -> str: ...

    @property
    def label(self) -> str:
        """What logs and the command log call it."""
        return self.op.value


# Seconds a host may answer nothing while a command runs before it is UNREACHABLE (--host-timeout); a command
# may run longer than that (its own `timeout`) as long as the host answers (remote/ssh.py asks it).
HOST_TIMEOUT = 60.0


@dataclass(frozen=True)
class Command:
    intent: Intent
    stdin: bytes = b""
    timeout: float = 120.0
    check: bool = True  # a non-zero exit raises RemoteError
    # Bytes streamed to the script's stdin after `stdin` (file copies): produced while sending, so a large
    # file is never held in memory, and a stream that stops early ends the script's input there.
    stream: Iterable[bytes] | None = None

    @property
    def op(self) -> Op:
        return self.intent.op

    @property
    def script(self) -> str:
        return self.intent.render()

    @property
    def label(self) -> str:
        return self.intent.label


@dataclass(frozen=True)
class Script(Intent):
    """Shell text that means only itself."""

    op: ClassVar[Op] = Op.SCRIPT
    text: str

    def render(self) -> str:
        return self.text


def script(text: str, *, stdin: bytes = b"", check: bool = True, timeout: float = 120.0) -> Command:
    return Command(Script(text), stdin=stdin, check=check, timeout=timeout)
