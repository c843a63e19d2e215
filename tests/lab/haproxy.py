"""A real HAProxy in front of the lab's instances, and docs/hooks.md's HAProxy hook script, for rollout tests.

HAProxy (Debian's package; scripts/test installs it with socat, which the hook uses) runs in the foreground as
a child of the test, on 127.0.0.1 with a free port, its admin socket in the test's directory. Its backend is
the one docs/hooks.md shows: `vllm`, one server per instance named `<inventory host>-<instance index>`, checked
with `GET /health` (every second, so a test need not wait long for a state change). A test reads each server's
state and current sessions from HAProxy itself (`show stat`), so it can fail on what the balancer did, not only
on what ernie-deploy reports.
"""

from __future__ import annotations

import csv
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
        """One command on the admin socket and HAProxy's whole answer (it closes the connection after it)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def stats(self) -> dict[str, ServerStat]:
        """Each server of the backend by name, as `show stat` reports it."""
        text = self.command("show stat").removeprefix("# ")
        rows = csv.DictReader(line for line in text.splitlines() if line)
        return {r["svname"]: ServerStat(r["status"], int(r["scur"]), int(r["stot"]), int(r["econ"]), int(r["eresp"]))
                for r in rows if r["pxname"] == BACKEND and r["svname"] in self.servers}

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
