"""The story of an engine that died, told from the unit's journal: when it died and by which line, how the process
ended, whether systemd brought it back and when it served again, or why it stays down.

vLLM's API server exits 0 when its engine dies (real 0.32.0: `kill -9` of `VLLM::EngineCore` or of one TP worker,
tests/fixtures/real-vllm/0.32.0/README.md; vLLM issue #48966), so systemd's own words say nothing more than
"Deactivated successfully": only vLLM's death lines tell a death from a stop. The lines come from
`journalctl -u UNIT -o short-unix` (the unit's own lines and systemd's about it, each with its time in epoch
seconds), already narrowed by the host to the lines matched by HOST_PATTERN (remote/facts.py). Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ernie_deploy.checks.signatures import ENGINE_DIED, strip_prefix
from ernie_deploy.planning.restarts import START_LIMIT_BURST, START_LIMIT_INTERVAL_S

# What the host keeps of the journal (grep -E): death lines, systemd's lines about the unit's runs, and uvicorn's
# line that the server listens again. Loose on purpose; `events` classifies each line exactly.
HOST_PATTERN = ("died unexpectedly|engine core exited unexpectedly|EngineCore encountered a fatal error|"
                "killed by the OOM killer|systemd\\[1\\]: |Application startup complete")

# systemd's messages (systemd 252 src/core/service.c, unit.c; real lines in tests/fixtures/logs/real/).
_SYSTEMD = re.compile(r"^(?:\S+\.service: )?(?P<msg>.*)$")
_RESTART = re.compile(r"Scheduled restart job, restart counter is at (?P<n>\d+)")
_GAVE_UP = re.compile(r"Start request repeated too quickly|Failed with result 'start-limit-hit'")
_EXITED = re.compile(r"Main process exited, (?P<how>code=\w+, status=\S+)")
_OOM = re.compile(r"killed by the OOM killer")
_STOP = re.compile(r"^Stopping \S.*(?:\.\.\.|…)$")
_START = re.compile(r"^Start(?:ing \S.*(?:\.\.\.|…)|ed \S.*\.)$")
_READY = re.compile(r"Application startup complete")
_LINE = re.compile(r"^(?P<at>\d+(?:\.\d+)?) \S+ (?P<ident>[^\s:\[]+)(?:\[(?P<pid>\d+)\])?: (?P<msg>.*)$")


@dataclass(frozen=True)
class Event:
    at: float  # epoch seconds
    kind: str  # death | exited | oom | restart | gave-up | stop | start | ready
    text: str  # the message (systemd's without the unit's name, vLLM's without its prefixes)


def events(lines: Iterable[str]) -> list[Event]:
    """The journal lines that tell a run's end and beginning, classified; other lines are dropped."""
    out = []
    for line in lines:
        m = _LINE.match(line.rstrip("\r\n"))
        if m is None:
            continue
        at, msg = float(m["at"]), m["msg"]
        if m["ident"] == "systemd" and m["pid"] == "1":
            text = _SYSTEMD.match(msg)["msg"]  # type: ignore[index]  # the pattern matches every string
            kind = next((k for k, rx in (("restart", _RESTART), ("gave-up", _GAVE_UP), ("exited", _EXITED),
                                         ("oom", _OOM), ("stop", _STOP), ("start", _START)) if rx.search(text)), None)
        else:
            text = strip_prefix(msg)
            kind = "death" if ENGINE_DIED.search(text) else "ready" if _READY.search(text) else None
        if kind is not None:
            out.append(Event(at, kind, text.strip()))
    return out


@dataclass
class Death:
    """One death of the engine and what followed it, up to the next death or a start or stop asked for."""

    at: float
    line: str  # the first death line (vLLM's words), or systemd's OOM line
    exit: str | None = None  # systemd's "code=exited, status=1/FAILURE"; None: it exited 0 (or is not gone yet)
    restarted_at: float | None = None
    serving_at: float | None = None
    gave_up: bool = False
    deaths: int = 1  # deaths since the last start asked for (this one included)

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "line": self.line, "exit": self.exit, "restarted_at": self.restarted_at,
                "serving_at": self.serving_at, "serving_after_s": self.serving_after(),
                "gave_up": self.gave_up, "deaths": self.deaths}

    def serving_after(self) -> float | None:
        return None if self.serving_at is None else round(self.serving_at - self.at, 1)


def last_death(lines: Iterable[str]) -> Death | None:
    """The last death since the unit was last started or stopped on request (by ernie-deploy, systemctl, a
    reboot), or None when it has not died since. A start systemd makes after a death (Restart=) is part of the
    death's story; any other start or stop ends it."""
    death: Death | None = None
    for ev in events(lines):
        if ev.kind in ("death", "oom"):
            if death is None:
                death = Death(ev.at, ev.text)
            elif death.restarted_at is not None:  # died again after systemd brought it back
                death = Death(ev.at, ev.text, deaths=death.deaths + 1)
        elif death is None:
            continue
        elif ev.kind == "exited" and death.restarted_at is None:
            death.exit = ev.text.partition("Main process exited, ")[2].rstrip(".")
        elif ev.kind == "restart":
            death.restarted_at = death.restarted_at or ev.at
        elif ev.kind == "ready" and death.restarted_at is not None and death.serving_at is None:
            death.serving_at = ev.at
        elif ev.kind == "gave-up":
            death.gave_up = True
        elif ev.kind == "stop" or (ev.kind == "start" and death.restarted_at is None):
            death = None
    return death


def clock(at: float) -> str:
    """Epoch seconds as a UTC date and time (the proleptic Gregorian calendar, from days since 1970-01-01 by
    Howard Hinnant's civil_from_days): pure arithmetic, as this layer reads no clock and imports no time module."""
    days, rest = divmod(int(at), 86400)
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day, month = doy - (153 * mp + 2) // 5 + 1, mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (month <= 2)
    return f"{year:04d}-{month:02d}-{day:02d} {rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d} UTC"


@dataclass(frozen=True)
class Story:
    """What happened, in one sentence, and the next step when the instance is not serving again."""

    text: str
    fix: str | None
    serving: bool  # it came back and serves

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "fix": self.fix, "serving": self.serving}


def tell(death: Death, *, active: bool, sub_state: str, restart_policy: str, deploy: str) -> Story:
    """The story of `death` given the unit's state now; `deploy` is the command that starts it again."""
    exited = f"the server exited ({death.exit})" if death.exit else "the server exited 0"
    head = f"engine died at {clock(death.at)} ({death.line}); {exited}"
    if death.deaths > 1:
        head = f"engine died {death.deaths} times; the last at {clock(death.at)} ({death.line}); {exited}"
    if active and death.serving_at is not None:
        return Story(f"{head}; restarted by systemd, serving again after {death.serving_after():.0f} s", None, True)
    if active and death.restarted_at is not None:
        return Story(f"{head}; restarted by systemd at {clock(death.restarted_at)}, loading again", None, False)
    if sub_state == "auto-restart":
        return Story(f"{head}; systemd restarts it after RestartSec", None, False)
    if death.gave_up:
        return Story(f"{head}; not restarted: systemd gave up at the unit's start limit ({START_LIMIT_BURST} starts "
                     f"in {START_LIMIT_INTERVAL_S // 60} minutes)",
                     f"read why it keeps dying in the journal, then {deploy}", False)
    if not death.exit and restart_policy not in ("always", ""):
        return Story(f"{head}; not restarted: the unit's Restart={restart_policy} does not restart a clean exit "
                     "(a unit rendered before ernie-deploy used Restart=always)",
                     f"{deploy} renders Restart=always and starts it", False)
    return Story(f"{head}; not restarted", f"read why in the journal, then {deploy}", False)
