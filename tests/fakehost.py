"""A scripted stand-in for one SSH host, for orchestration tests without a network.

It answers the typed commands the orchestration sends by their intent (never by shell text or display label):
facts from its in-memory state, the deploy lock, stage (the files of the tar payload installed where the
intent says, a release recorded), activate (units restarted), stop, restore and undo, and the probes of a
running instance: systemd state, a start-up journal (real simulator output for the unit's TP, with the unit's
values), nvidia-smi, the process tree and the HTTP answers (/health, /v1/models, a completion) the host would
get. A host with a `FakeBalancer` also answers a balancer's apply and HAProxy's runtime API. Anything else fails.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import re
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from ernie_deploy.checks.progress import RUNNING, WAITING, has_work
from ernie_deploy.orchestration.progress import MARK as PROGRESS_MARK
from ernie_deploy.orchestration.progress import ReadProgress
from ernie_deploy.planning.hostpaths import RELEASES_DIR
from ernie_deploy.remote import bench, http
from ernie_deploy.remote.balancer import ANSWER, ApplyBalancer, BalancerAdmin
from ernie_deploy.remote.command import Command, Op
from ernie_deploy.remote.converge import Activate, ReadFiles, Stage
from ernie_deploy.remote.facts import Facts
from ernie_deploy.remote.lock import HELD_EXIT, Acquire, BreakLock, ReleaseLock, ShowLock
from ernie_deploy.remote.probe import Probe, Watch
from ernie_deploy.remote.releases import ListReleases, Restore, Undo
from ernie_deploy.remote.rolling import GpuRelease, Metrics, Stop
from ernie_deploy.remote.ssh import Failure, RemoteError, RunResult, Target

ROOT = Path(__file__).resolve().parent.parent
CONFIG = (ROOT / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json").read_text()
# A real `vllm bench serve` result (tests/fixtures/bench/README.md): what a bench that finished saves.
BENCH_RESULT = (ROOT / "tests/fixtures/bench/vllm-0.32.0-random.json").read_text()
LOGS = {1: "healthy-0.11.0-tp1.log", 2: "healthy-0.34.0-tp2.log", 4: "healthy-0.34.0-tp4.log"}
MARK = "@@ernie-deploy:"
# What an instance's /metrics shows with nothing to do (the progress reader's families only).
IDLE_PAGE = ('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
             'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
             'vllm:generation_tokens_total{engine="0",model_name="m"} 0.0\n')


def startup_journal(tp: int, max_len: int) -> list[str]:
    """Real simulator start-up lines for this TP, with the unit's max_model_len."""
    lines = [x for x in (ROOT / "tests/fixtures/logs/sim" / LOGS[tp]).read_text().splitlines()
             if not x.startswith("#")]
    text = "\n".join(lines)
    for pattern in (r"(max_seq_len=)\d+", r"('max_model_len': )\d+", r"(max model len )\d+", r"(max_model_len=)\d+"):
        text = re.sub(pattern, rf"\g<1>{max_len}", text)
    return text.splitlines()


@dataclass
class Unit:
    tp: int
    max_len: int
    name: str
    gpus: tuple[int, ...]
    port: int


def parse_unit(text: str) -> Unit:
    def flag(name: str, default: str) -> str:
        m = re.search(rf"--{name}[ =](\S+)", text)
        return m.group(1).strip("'\"") if m else default

    gpus = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)", text)
    return Unit(int(flag("tensor-parallel-size", "1")), int(flag("max-model-len", "0")),
                flag("served-model-name", "?"), tuple(int(g) for g in gpus.group(1).split(",")) if gpus else (0,),
                int(flag("port", "8000")))


@dataclass
class FakeServer:
    status: str = "UP"
    scur: int = 0
    weight: int = 1


@dataclass
class FakeBalancer:
    """HAProxy on a balancer host: its configuration, whether it runs, and its servers as `show stat` reports
    them. An applied configuration's `backend`/`server` lines become the servers (UP, no sessions)."""

    installed: bool = True
    running: bool = True
    config: str | None = None
    invalid: str | None = None  # a configuration containing this text fails `haproxy -c`
    reload_fails: bool = False  # reload and start fail (the previous file is put back, as the script does)
    socket: str = "ok"  # how the admin socket answers: ok, missing, denied, refused
    servers: dict[tuple[str, str], FakeServer] = field(default_factory=dict)
    draining: list[int] = field(default_factory=list)  # a drained server's scur in turn, one per `show stat`
    stay_down: set[str] = field(default_factory=set)  # servers that stay DOWN after `ready` (checks fail)
    log: list[str] = field(default_factory=list)  # "reload", "start", "install", "set B/S drain", ...

    def apply(self, intent: ApplyBalancer, config: str) -> str:
        out = []
        if not self.installed:
            if intent.check:
                return f"{MARK}install\n{MARK}changed\n{MARK}start\n{MARK}done\n"
            self.installed = True
            self.log.append("install")
            out.append("installed")
        if self.invalid is not None and self.invalid in config:
            return "".join(f"{MARK}{e}\n" for e in out) + (
                f"{MARK}error invalid\n[ALERT]    (1) : config : parsing [{intent.config}.ernie-new:3] : "
                f"unknown keyword '{self.invalid}'\n[ALERT]    (1) : config : Fatal errors found in configuration.\n")
        if config == self.config:
            out.append("unchanged")
        elif intent.check:
            out.append("changed")
        else:
            out.append("changed")
            if self.reload_fails:
                self.log.append("reload failed" if self.running else "start failed")
                return "".join(f"{MARK}{e}\n" for e in [*out, "restored"]) + (
                    f"{MARK}error {'reload' if self.running else 'start'}\nJob for haproxy.service failed.\n")
            self.config = config
            self.servers = self.parse(config)
            out.append("reloaded" if self.running else "started")
            self.log.append(out[-1])
            self.running = True
        if not self.running:
            if intent.check:
                out.append("start")
            else:
                self.running = True
                self.log.append("started")
                out.append("started")
        return "".join(f"{MARK}{e}\n" for e in [*out, "done"])

    def parse(self, config: str) -> dict[tuple[str, str], FakeServer]:
        servers, backend = {}, ""
        for line in config.splitlines():
            # HAProxy unquotes words as a shell does; the rendered config quotes every name.
            words = shlex.split(line, comments=True)
            if words[:1] == ["backend"]:
                backend = words[1]
            elif words[:1] == ["server"] and backend:
                weight = int(words[words.index("weight") + 1]) if "weight" in words else 1
                old = self.servers.get((backend, words[1]))
                servers[(backend, words[1])] = old or FakeServer(weight=weight)
        return servers

    def admin(self, spec: dict[str, object]) -> str:
        if self.socket != "ok" or not self.running:
            error = self.socket if self.socket != "ok" else "refused"
            return f"{MARK}{ANSWER} " + json.dumps({"i": "*", "error": error, "detail": f"[Errno] {error}"}) + "\n"
        out = []
        commands = spec["commands"]
        assert isinstance(commands, list)
        for i, command in enumerate(commands):
            out.append(f"{MARK}{ANSWER} " + json.dumps({"i": i, "answer": self.answer(str(command))}))
        return "\n".join(out) + "\n"

    def answer(self, command: str) -> str:
        if command == "show stat":
            rows = ["# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,"
                    "wredis,status,weight,act"]
            for (b, s), server in self.servers.items():
                if server.status == "DRAIN":
                    server.scur = self.draining.pop(0) if self.draining else 0
                rows.append(f"{b},{s},0,0,{server.scur},0,,0,0,0,,0,,0,0,0,0,{server.status},{server.weight},1")
            rows += [f"{b},BACKEND,0,0,0,0,,0,0,0,,0,,0,0,0,0,UP,1,1" for b in sorted({b for b, _ in self.servers})]
            return "\n".join(rows) + "\n\n"
        _, _, target, _, state = command.split()
        backend, _, name = target.partition("/")
        if not any(b == backend for b, _ in self.servers):
            return "No such backend.\n\n"
        found = self.servers.get((backend, name))
        if found is None:
            return "No such server.\n\n"
        self.log.append(f"set {target} {state}")
        found.status = "DRAIN" if state == "drain" else "DOWN" if name in self.stay_down else "UP"
        return "\n"


@dataclass
class FakeHost:
    gpus: int = 2
    files: dict[str, str] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)  # unit → start count (present = running)
    starts: dict[str, int] = field(default_factory=dict)  # unit → how often it was started (kept after a stop)
    lock_info: str | None = None
    applied: list[Stage] = field(default_factory=list)  # the stages, in order
    releases: list[dict[str, object]] = field(default_factory=list)
    pending: set[str] = field(default_factory=set)
    pending_from: dict[str, str] = field(default_factory=dict)  # pending unit → the release it ran when staged
    unreachable: bool = False
    restart_marker: bool = True  # False: activate prints no marker (a host that swallows output)
    serve_len: int | None = None  # /v1/models reports this max_model_len instead of the unit's
    model_readable: bool | None = None  # can vllm_user read config.json (None: no such user on the host)
    killed_on_stop: bool = False  # stop reports the old process was SIGKILLed after TimeoutStopSec
    fail_on: Op | None = None  # raise an unexpected (non-ernie) exception on this operation
    silent_from: Op | None = None  # from this operation on the host answers nothing, as remote/ssh.py reports it
    release_files: dict[str, dict[str, str]] = field(default_factory=dict)  # release id → path → content
    failed_marks: dict[str, str] = field(default_factory=dict)  # release id → its failed.json (an Undo wrote it)
    vllm: str = "0.34.0"  # the version the default venv path has installed
    running_vllm: dict[str, str] = field(default_factory=dict)  # unit → the version its process uses (else vllm)
    ctimes: dict[str, int] = field(default_factory=dict)  # file → its ctime (epoch seconds), in the facts if set
    wall_now: float | None = None  # the host's clock in the facts (processes started 1000 s before it)
    orphan: int | None = None  # a PID holding GPU 0 after every stop (the GPU release gate must wait for it)
    in_flight: list[int] = field(default_factory=list)  # /metrics answers in turn (running + waiting); then 0
    fail_start: str | None = None  # starts fail at once with a fatal start-up line when the unit file
    #                                contains this text (or each part of "A && B"), e.g. a changed flag
    log: list[str] = field(default_factory=list)  # what happened, in order: "stop U", "start U", "undo ..."
    received: list[Command] = field(default_factory=list)  # every command sent to it, in order
    balancer: FakeBalancer | None = None  # HAProxy, on a balancer host
    # How `vllm bench serve` ends per unit: "ok" (the default: the real result file), "timeout" (stopped at its
    # bound after 9 requests), "fail" (exits 1 with vLLM's error, no result), or a JSON text saved as the result.
    bench_ends: dict[str, str] = field(default_factory=dict)
    # The same per deployed settings (calibrate's candidates): the first entry whose text the unit file contains
    # (each part of "A && B") decides, before bench_ends.
    bench_when: dict[str, str] = field(default_factory=dict)
    # The progress reader's /metrics pages per instance unit (no ".service"), round 1 then round 2; "HTTP 404"
    # answers that status. Unset: an idle page while the unit runs. `progress_reads` records each reading the
    # host's program made, (unit, round), deciding on a second one as the program does (checks.progress.has_work).
    progress_pages: dict[str, list[str]] = field(default_factory=dict)
    progress_reads: list[tuple[str, int]] = field(default_factory=list)

    def facts_text(self) -> str:
        gpus = "\n".join(f"{i}, NVIDIA A10, GPU-{i:08d}-0000-0000-0000-000000000000, 23028, 550.127.05"
                         for i in range(self.gpus))
        hashes = "\n".join(f"{hashlib.sha256(c.encode()).hexdigest()}  {p}" for p, c in sorted(self.files.items()))
        units = "\n\n".join(self.show(u) for u in self.unit_names())
        return (f"\n{MARK}gpus\n{gpus}\nrc=0\n{MARK}topo\n\n{MARK}systemd\nsystemd 252\n"
                f"{MARK}files\n{hashes}\n{MARK}units\n{units}\n{MARK}unitgpus\n"
                + "".join(f"{u} {','.join(map(str, self.unit(u).gpus))}\n" for u in self.unit_names())
                + f"{MARK}now\n{10**9}\n{MARK}health\n" + "".join(f"{u} 200\n" for u in self.active) +
                f"{MARK}model\n{CONFIG}\nrc=0\n{MARK}modeluser\n"
                + {True: "readable\n", False: "unreadable\n", None: ""}[self.model_readable]
                + f"{MARK}vllm\n{self.vllm}\nrc=0\n{MARK}running\n"
                + "".join(f"{u}\t/opt/vllm/{v}/bin/vllm\t{v}\n"
                          for u, v in ((u, self.running_vllm.get(u, self.vllm)) for u in sorted(self.active)))
                + f"{MARK}ctimes\n" + "".join(f"{t} {p}\n" for p, t in sorted(self.ctimes.items()))
                + (f"{MARK}wallnow\n{self.wall_now}\n" if self.wall_now is not None else "")
                + f"{MARK}lock\n{self.lock_info or ''}\n{MARK}pending\n"
                + "\n".join(f"{u} {self.pending_from[u]}" if u in self.pending_from else u
                            for u in sorted(self.pending)) + f"\n{MARK}end\n")

    def unit_names(self) -> list[str]:
        return sorted({p.rsplit("/", 1)[1] for p in self.files if p.endswith(".service")})

    def show(self, u: str) -> str:
        running = u in self.active
        invocation = f"run-{self.starts[u]}" if u in self.starts else ""  # systemd has none before a first start
        return (f"Id={u}\nLoadState=loaded\nActiveState={'active' if running else 'inactive'}\n"
                f"SubState={'running' if running else 'dead'}\nResult=success\nMainPID={self.pid(u) if running else 0}"
                f"\nInvocationID={invocation}\nNRestarts=0\nExecMainStartTimestampMonotonic={self.active.get(u, 0)}\n"
                f"UnitFileState=enabled")

    def pid(self, u: str) -> int:
        return 1000 + 100 * self.unit_names().index(u)

    def unit(self, u: str) -> Unit:
        return parse_unit(self.files[f"/etc/systemd/system/{u}"])

    def stage(self, stage: Stage, stdin: bytes) -> None:
        with tarfile.open(fileobj=io.BytesIO(stdin)) as tar:
            staged = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
        for f in stage.files:
            self.files[f.path] = staged[f.member]
        record = json.loads(staged["release.json"])
        self.releases.append(record)
        self.release_files[str(record["id"])] = dict(self.files)
        for unit, ran in stage.pending.items():
            if unit not in self.pending and ran:  # the first record of a unit is kept, as the awk on the host does
                self.pending_from[unit] = ran
            self.pending.add(unit)
        self.applied.append(stage)

    def activate(self, activate: Activate) -> str:
        for u in activate.start:
            self.starts[u] = self.starts.get(u, 0) + 1
            self.active[u] = self.starts[u]
            self.pending.discard(u)
            self.pending_from.pop(u, None)
            self.log.append(f"start {u}")
        if not self.restart_marker:
            return ""
        return "".join(f"{MARK}started {u} run-{self.active[u]} 0\n" for u in activate.start)

    def failing(self, u: str) -> bool:
        text = self.files.get(f"/etc/systemd/system/{u}", "")
        return self.fail_start is not None and all(part in text for part in self.fail_start.split(" && "))

    def stop(self, stop: Stop) -> str:
        self.active.pop(stop.unit, None)
        self.log.append(f"stop {stop.unit}")
        out = f"{MARK}stopped inactive\n" + (f"{MARK}killed\n" if self.killed_on_stop else "")
        # The stop command reads the GPUs right after the stop when asked (remote/rolling.py stop_command).
        return out + (self.gpu_release(GpuRelease(stop.gpu_units)) if stop.gpu_units else "")

    def gpu_release(self, release: GpuRelease) -> str:
        out = []
        for u in release.units:
            out += [f"{MARK}unit {u}", self.show(u) if u in self.unit_names() else f"Id={u}", f"{MARK}baseline {u}"]
        used = {g: 20500 for u in self.active if u in self.unit_names() for g in self.unit(u).gpus}
        if self.orphan is not None:
            used[0] = used.get(0, 0) + 20000
        out.append(f"{MARK}gpus")
        out += [f"{i}, GPU-{i:08d}-0000-0000-0000-000000000000, {used.get(i, 0)}, 23028, 0" for i in range(self.gpus)]
        out.append(f"{MARK}apps")
        if self.orphan is not None:
            out.append(f"{self.orphan}, 20000, GPU-00000000-0000-0000-0000-000000000000")
        out += [f"{MARK}ps", f"{self.orphan} VLLM::EngineCore" if self.orphan else "", f"{MARK}cgroups"]
        return "\n".join(out) + "\n"

    def metrics(self, metrics: Metrics) -> str:
        left = self.in_flight.pop(0) if self.in_flight else 0
        body = (f"vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {float(left)}\n"
                'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n')
        return http.MARK + json.dumps({"id": metrics.request.id, "status": 200, "error": None, "seconds": 0.01,
                                       "body": base64.b64encode(body.encode()).decode()}) + "\n"

    def restore(self, restore: Restore) -> None:
        for path in restore.paths:
            self.files[path] = self.release_files[restore.release][path]
        self.pending |= set(restore.units)

    def undo(self, undo: Undo) -> None:
        for restore in undo.back.values():
            self.restore(restore)
        for u in undo.stop + undo.disable:
            self.active.pop(u, None)
        self.pending -= set(undo.units)
        if undo.failed is not None and undo.failed[0] in self.release_files:
            self.failed_marks[undo.failed[0]] = json.dumps(undo.failed[1].to_json())
        for u in undo.units:
            self.pending_from.pop(u, None)
        self.log.append("undo " + " ".join(undo.units))

    def read(self, read: ReadFiles) -> str:
        out = []
        for path in read.paths:
            rid, _, kept = path.removeprefix(RELEASES_DIR + "/").partition("/")
            inside = path.startswith(RELEASES_DIR + "/")
            content = self.release_files[rid].get("/" + kept) if inside else self.files.get(path)
            out.append(f"@@ernie-deploy:file {path}\n{content or ''}")
        return "".join(out)

    def probe(self, cmd: Command) -> str:
        intent = cmd.intent
        assert isinstance(intent, (Probe, Watch))
        out = [f"{MARK}http"] if intent.requests else []
        for r in intent.requests:
            out.append(http.MARK + json.dumps(self.answer(r)))
        apps, used = [], {}
        for u in intent.units if isinstance(intent, Probe) else (intent.unit,):
            state = self.show(u) if u in self.unit_names() else f"Id={u}\nLoadState=not-found"
            out += [f"{MARK}unit {u}", state, f"{MARK}journal {u} run-{self.active.get(u, 0)}"]
            if u in self.active and self.failing(u):
                out += ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "-- cursor: s=1"]
            elif u in self.active:
                unit = self.unit(u)
                out += [*startup_journal(unit.tp, unit.max_len), "-- cursor: s=1"]
        for u in self.active:
            if u in self.unit_names():
                for rank, g in enumerate(self.unit(u).gpus):
                    apps.append(f"{self.pid(u) + 1 + rank}, 20000, GPU-{g:08d}-0000-0000-0000-000000000000")
                    used[g] = 20500
        if isinstance(intent, Probe):
            out += [f"{MARK}gpus"] + [f"{i}, GPU-{i:08d}-0000-0000-0000-000000000000, {used.get(i, 0)}, 23028, "
                                      f"{40 if i in used else 0}" for i in range(self.gpus)]
            out += [f"{MARK}apps", *apps, f"{MARK}ps"]
            out += [f"{self.pid(u) + k} {self.pid(u) if k else 1}" for u in self.active if u in self.unit_names()
                    for k in range(0, 1 + len(self.unit(u).gpus))]
        return "\n".join(out) + "\n"

    def bench_run(self, intent: bench.Bench) -> str:
        """What the host program prints: /health (refused for a unit not running), the counters, the exit, the
        result."""
        def event(kind: str, **data: object) -> str:
            return bench.MARK + json.dumps({"event": kind, **data}) + "\n"

        if intent.unit not in self.active:
            return event("health", status=None, error="[Errno 111] Connection refused")
        text = self.files.get(f"/etc/systemd/system/{intent.unit}", "")
        how = next((end for when, end in self.bench_when.items() if all(p in text for p in when.split(" && "))),
                   self.bench_ends.get(intent.unit, "ok"))
        labels = f'engine="0",model_name="{intent.served}"'
        count = {"timeout": 9}.get(how, 20)
        before = f'vllm:request_success_total{{{labels},finished_reason="length"}} 100.0\n' \
                 f"vllm:generation_tokens_total{{{labels}}} 1000.0"
        after = f'vllm:request_success_total{{{labels},finished_reason="length"}} {100 + count}.0\n' \
                f"vllm:generation_tokens_total{{{labels}}} {1000 + 512 * count}.0"
        out = event("health", status=200, error=None) + event("metrics", when="before", text=before)
        if how == "timeout":
            return out + event("exit", code=-2, timed_out=True, seconds=intent.timeout, tail=["nanobind: leaked"]) \
                + event("metrics", when="after", text=after)
        if how == "fail":
            tail = ["ValueError: Initial test run failed - Please make sure benchmark arguments are correctly "
                    "specified. Error: Not Found", "nanobind: leaked 4 instances!"]
            return out + event("exit", code=1, timed_out=False, seconds=3.0, tail=tail) \
                + event("metrics", when="after", text=after)
        text = BENCH_RESULT if how == "ok" else how
        return out + event("exit", code=0, timed_out=False, seconds=12.0, tail=[]) \
            + event("metrics", when="after", text=after) + event("result", text=text)

    def progress(self, intent: ReadProgress) -> str:
        def reading(unit: str, url: str, round_: int) -> dict[str, object]:
            self.progress_reads.append((unit, round_))
            port = int(url.split(":")[2].split("/")[0])
            if not any(self.unit(u).port == port for u in self.active if u in self.unit_names()):
                return {"id": unit, "round": round_, "status": None, "error": "[Errno 111] Connection refused",
                        "seconds": 0.0, "body": ""}
            pages = self.progress_pages.get(unit) or [IDLE_PAGE]
            page = pages[min(round_, len(pages)) - 1]
            status = int(page.split()[1]) if page.startswith("HTTP ") else 200
            return {"id": unit, "round": round_, "status": status, "error": None, "seconds": 0.01,
                    "body": page if status == 200 else ""}

        first = [reading(u, url, 1) for u, url in zip(intent.units, intent.urls, strict=True)]
        second = [reading(u, url, 2) for u, url, r in zip(intent.units, intent.urls, first, strict=True)
                  if has_work(str(r["body"]), RUNNING, WAITING)]
        return "".join(PROGRESS_MARK + json.dumps(r) + "\n" for r in first + second)

    def answer(self, r: http.Request) -> dict[str, object]:
        url = r.url
        port = int(url.split(":")[2].split("/")[0])
        running = [self.unit(u) for u in self.active if u in self.unit_names() and self.unit(u).port == port]
        if not running:
            return {"id": r.id, "status": None, "error": "[Errno 111] Connection refused", "seconds": 0.0,
                    "body": ""}
        unit = running[0]
        if url.endswith("/health"):
            body = b""
        elif url.endswith("/v1/models"):
            body = json.dumps({"object": "list", "data": [{"id": unit.name, "object": "model",
                                                           "max_model_len": self.serve_len or unit.max_len}]}).encode()
        else:
            body = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": unit.name,
                               "choices": [{"index": 0, "text": " Paris.", "finish_reason": "length"}],
                               "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}).encode()
        return {"id": r.id, "status": 200, "error": None, "seconds": 0.01, "first_byte": 0.005,
                "body": base64.b64encode(body).decode()}


@dataclass
class FakeSession:
    host: FakeHost
    target: Target
    commands: int = 0
    history: list[str] = field(default_factory=list)

    def run(self, cmd: Command) -> RunResult:
        self.commands += 1
        self.history.append(cmd.label)
        h = self.host
        h.received.append(cmd)
        if h.fail_on is cmd.op:
            raise ValueError(f"fake failure on {cmd.op.value}")
        if h.silent_from is cmd.op or any(c.op is h.silent_from for c in h.received[:-1]):
            raise RemoteError(Failure.UNREACHABLE, f"the host answered nothing for 60s (while running {cmd.label})",
                              where=self.target.name)
        if isinstance(cmd.intent, Acquire):
            info = cmd.intent.info
            if h.lock_info and info.token not in h.lock_info:
                return RunResult(cmd.label, HELD_EXIT, f"{MARK}lock-held\n{h.lock_info}\n".encode(), b"")
            h.lock_info = h.lock_info or info.to_json()
            text = self.reply(dataclasses.replace(cmd, intent=cmd.intent.then))  # the read under the lock
        else:
            text = self.reply(cmd)
        if text is None:
            result = RunResult(cmd.label, 127, b"", f"fake host: no answer for {cmd.op}".encode())
            if cmd.check:
                raise RemoteError(Failure.COMMAND, f"{cmd.label} exited 127", where=self.target.name)
            return result
        return RunResult(cmd.label, 0, text.encode(), b"")

    def reply(self, cmd: Command) -> str | None:
        """What the host prints for the command, from what it means; None: no answer for it."""
        h = self.host
        match cmd.intent:
            case Facts():
                return h.facts_text()
            case Stage() as stage:
                h.stage(stage, cmd.stdin)
                # The stage reads the GPUs right after when asked (remote/converge.py stage_command).
                return f"{MARK}release x\n" + (h.gpu_release(GpuRelease(stage.gpu_units)) if stage.gpu_units else "")
            case Activate() as activate:
                return h.activate(activate)
            case ReleaseLock() | BreakLock():
                h.lock_info = None
                return ""
            case ShowLock():
                return h.lock_info or ""
            case Probe() | Watch():
                return h.probe(cmd)
            case ReadFiles() as read:
                return h.read(read)
            case ListReleases():
                return "".join(f"{MARK}release-json {json.dumps(r)}\n"
                               + (f"{MARK}release-failed {h.failed_marks[str(r['id'])]}\n"
                                  if str(r["id"]) in h.failed_marks else "") for r in h.releases)
            case Stop() as stop:
                return h.stop(stop)
            case GpuRelease() as release:
                return h.gpu_release(release)
            case Metrics() as metrics:
                return h.metrics(metrics)
            case Undo() as undo:
                h.undo(undo)
                return ""
            case Restore() as restore:
                h.restore(restore)
                return ""
            case ApplyBalancer() as apply if h.balancer is not None:
                return h.balancer.apply(apply, cmd.stdin.decode())
            case BalancerAdmin() if h.balancer is not None:
                return h.balancer.admin(json.loads(cmd.stdin))
            case bench.Bench() as run:
                return h.bench_run(run)
            case ReadProgress() as read_progress:
                return h.progress(read_progress)
        return None

    def close(self) -> None:
        pass


def connector(hosts: dict[str, FakeHost]):  # type: ignore[no-untyped-def]
    def connect(target: Target) -> FakeSession:
        host = hosts[target.name]
        if host.unreachable:
            raise RemoteError(Failure.UNREACHABLE, f"{target.address}:22: connection refused", where=target.name)
        return FakeSession(host, target)

    return connect
