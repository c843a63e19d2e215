"""Real HAProxy for rollout tests, read independently of ernie-deploy: a test can fail on what the balancer did,
not only on what ernie-deploy reports.

`HAProxy`: one HAProxy (Debian's package; scripts/test installs it with socat, which the hook uses) in the
foreground as a child of the test, on 127.0.0.1 with a free port, its admin socket in the test's directory. Its
backend is the one docs/hooks.md shows: `vllm`, one server per instance named `<inventory host>-<instance
index>`, checked with `GET /health` (every second, so a test need not wait long for a state change); the hook is
docs/hooks.md's own script.

`LabBalancer`: the HAProxy that `deploy` configured on a lab balancer host (`role: balancer`), as systemd runs
it there. Its admin socket lives in the container's /run, reached from this machine through the container's
init (`/proc/PID/root/...`): no SSH round trip, so a test can sample every server's state several times a
second. Its state changes come from the container's journal.
"""

from __future__ import annotations

import contextlib
import csv
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import wait_for

DOCS = Path(__file__).resolve().parent.parent.parent / "docs" / "hooks.md"
BACKEND = "vllm"
# The socket path in the docs' script; the copy a test runs points at the test's own socket instead.
DOCS_SOCKET = "SOCKET=/run/haproxy/admin.sock"


@dataclass(frozen=True)
class ServerStat:
    status: str  # UP, DOWN, DRAIN, MAINT, or a transition such as "DOWN 1/2"
    scur: int  # current sessions
    stot: int  # sessions in all
    econ: int  # connection errors towards the server
    eresp: int  # response errors (a server that closed mid-response, say)


def parse_stat(text: str) -> dict[tuple[str, str], ServerStat]:
    """`show stat`'s CSV: each server row by (backend, server); the FRONTEND/BACKEND summary rows skipped."""
    rows = csv.DictReader(line for line in text.removeprefix("# ").splitlines() if line)
    return {(r["pxname"], r["svname"]): ServerStat(r["status"], int(r["scur"]), int(r["stot"]), int(r["econ"] or 0),
                                                   int(r["eresp"] or 0))
            for r in rows if r["svname"] not in ("FRONTEND", "BACKEND")}


def admin_command(path: str | Path, line: str) -> str:
    """One command on an admin socket and HAProxy's whole answer (it closes the connection after it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def config(port: int, admin: Path, servers: dict[str, str]) -> str:
    lines = "".join(f"    server {name} {address} check\n" for name, address in servers.items())
    return f"""global
    stats socket {admin} mode 600 level admin

defaults
    mode http
    timeout connect 5s
    timeout client 10m
    timeout server 10m

frontend api
    bind 127.0.0.1:{port}
    default_backend {BACKEND}

backend {BACKEND}
    mode http
    balance leastconn
    option httpchk GET /health
    default-server inter 1s
{lines}"""


class HAProxy:
    """One HAProxy process; `running` starts it and always stops it."""

    def __init__(self, workdir: Path, servers: dict[str, str]) -> None:
        self.workdir = workdir
        self.servers = servers
        self.socket = workdir / "admin.sock"
        self.port = free_port()
        self.frontend = f"127.0.0.1:{self.port}"
        self.log = workdir / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("haproxy")
        assert binary and shutil.which("socat"), "haproxy and socat are missing: apt-get install haproxy socat " \
                                                 "(scripts/test installs them)"
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(config(self.port, self.socket, self.servers))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=log, stderr=subprocess.STDOUT)
        up = wait_for(lambda: self._answers() and all(s.status == "UP" for s in self.stats().values()), 20)
        assert up, f"HAProxy did not come up with every server UP: {self.log.read_text()[-2000:]}"

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def command(self, line: str) -> str:
        return admin_command(self.socket, line)

    def stats(self) -> dict[str, ServerStat]:
        """Each server of the backend by name, as `show stat` reports it."""
        return {server: stat for (backend, server), stat in parse_stat(self.command("show stat")).items()
                if backend == BACKEND and server in self.servers}

    def states(self) -> dict[str, str]:
        return {name: stat.status for name, stat in self.stats().items()}

    def events(self, server: str) -> list[str]:
        """HAProxy's own log of the server's state changes, oldest first: under -db it writes each to stderr
        ("enters drain state", "is DOWN, reason: ...", "is UP (leaving forced drain)")."""
        mark = f"Server {BACKEND}/{server} "
        return [line.split(mark, 1)[1] for line in self.log.read_text().splitlines() if mark in line]

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"HAProxy exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        try:
            return bool(self.command("show info"))
        except OSError:
            return False


@contextmanager
def running(workdir: Path, servers: dict[str, str]) -> Iterator[HAProxy]:
    proxy = HAProxy(workdir, servers)
    try:
        proxy.start()
        yield proxy
    finally:
        proxy.stop()


def hook_script(directory: Path, admin: Path) -> Path:
    """docs/hooks.md's HAProxy hook, copied from the docs at test time (so the two cannot drift), with its
    SOCKET pointed at `admin`."""
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", DOCS.read_text(), re.DOTALL) if "set server" in b]
    assert len(blocks) == 1, f"expected one ```sh block with `set server` in {DOCS}, found {len(blocks)}"
    (text,) = blocks
    assert text.count(DOCS_SOCKET) == 1, f"{DOCS}: the hook no longer sets {DOCS_SOCKET}"
    path = directory / "haproxy-hook.sh"
    path.write_text(text.replace(DOCS_SOCKET, f"SOCKET={admin}"))
    return path


# HAProxy's own line for a server's state change, as its unit's stderr puts it in the journal: "[WARNING]  (126) :
# Server B/S enters drain state. ...". (The same event also arrives through syslog without the prefix; one form
# is read so each event counts once.)
_EVENT = re.compile(r": \[(?:WARNING|ALERT|NOTICE)\]\s+\(\d+\) : Server ([^/\s]+)/(\S+) (.*)$")


def server_events(journal: str, since: float = 0.0) -> dict[str, list[str]]:
    """Each server's state changes in journal text (`journalctl -o short-unix`) logged at or after `since`, oldest
    first: "enters drain state...", "is DOWN, reason: ...", "is UP/READY (leaving forced drain)..."."""
    events: dict[str, list[str]] = {}
    for line in journal.splitlines():
        stamp, _, rest = line.partition(" ")
        found = _EVENT.search(rest)
        if found and float(stamp) >= since:
            events.setdefault(found.group(2), []).append(found.group(3))
    return events


def drained_then_ready(events: list[str]) -> bool:
    """A drain, and after the last one the `state ready` that ends it ("(leaving forced drain)", logged with the
    state the checks see then: UP, or DOWN until they pass again)."""
    drains = [i for i, e in enumerate(events) if e.startswith("enters drain state")]
    return bool(drains) and any("(leaving forced drain)" in e for e in events[drains[-1]:])


@dataclass
class LabBalancer:
    """HAProxy on a lab balancer host, seen from this machine. `socket` is the path the rendered configuration
    gives its admin socket (vllm_balancer_admin_socket's default)."""

    lab: Lab
    name: str
    socket: str = "/run/haproxy/admin.sock"

    @property
    def state(self) -> LabState:
        return self.lab.require_state()

    @property
    def frontend(self) -> str:
        """"address:port" of its frontend, as the load generator takes it."""
        url = self.state.host(self.name).frontend
        assert url, f"{self.name} is not a lab balancer"
        return url.removeprefix("http://")

    def _socket_path(self) -> str:
        # The container's init is nspawn's only child; its root is the container's view, /run included.
        pid = self.state.host(self.name).pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 1, f"{self.name}: nspawn {pid} has children {children}, expected its init alone"
        return f"/proc/{children[0]}/root{self.socket}"

    def command(self, line: str) -> str:
        return admin_command(self._socket_path(), line)

    def answers(self) -> bool:
        try:
            return bool(self.command("show info"))
        except OSError:
            return False

    def worker_pid(self) -> str:
        """The serving worker's PID (`show info`): a reload replaces the worker, so an unchanged PID means the
        configuration was not reloaded."""
        info = dict(line.split(": ", 1) for line in self.command("show info").splitlines() if ": " in line)
        return info["Pid"]

    def stats(self) -> dict[str, ServerStat]:
        """Each server (`<host>-<index>`) of every backend, by name."""
        return {server: stat for (_backend, server), stat in parse_stat(self.command("show stat")).items()}

    def states(self) -> dict[str, str]:
        return {name: stat.status for name, stat in self.stats().items()}

    def all_up(self) -> bool:
        states = self.states()
        return bool(states) and set(states.values()) == {"UP"}

    def unit(self, command: str = "is-active") -> str:
        return self.lab.ssh(self.name, f"systemctl {command} haproxy.service").stdout.strip()

    def events(self, since: float) -> dict[str, list[str]]:
        """Each server's state changes HAProxy logged at or after `since` (wall clock)."""
        journal = self.lab.ssh(self.name, f"journalctl -u haproxy.service --no-pager -o short-unix "
                                          f"--since @{int(since)}")
        return server_events(journal.stdout, since)


@dataclass
class StateSampler:
    """Every `interval` seconds, every server's state as the balancer sees it; bounded like the load."""

    balancer: LabBalancer
    interval: float = 0.1
    max_seconds: float = 300.0
    samples: list[dict[str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def finish(self) -> list[dict[str, str]]:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.samples

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self.stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # a reload swaps the socket; the next sample reads the new one
                self.samples.append(self.balancer.states())
            self.stop.wait(self.interval)

    def most_out_at_once(self) -> int:
        """The most servers not UP (DRAIN, DOWN, MAINT, or between) in any one sample."""
        return max((sum(1 for s in states.values() if s != "UP") for states in self.samples), default=0)

    def seen(self, server: str, status: str) -> bool:
        return any(states.get(server) == status for states in self.samples)
