"""The lab's package index for real-vLLM hosts: the cached index directory (realvllm.py) served over HTTP on
loopback, which the containers share with this machine, so pip on a lab host installs from
`http://127.0.0.1:PORT/simple/` as it would from an operator's mirror.

`start` runs this module as its own process (new session, so a Ctrl-C of `lab up` does not reach it) and
records its PID in the lab state; `stop` only signals a PID whose command line is still this server serving
that directory (PIDs get reused).
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ernie_deploy.errors import DeployError

ADDRESS = "127.0.0.1"
MODULE = "ernie_deploy.lab.pkgindex"
START_TIMEOUT_S = 10.0


def url(port: int) -> str:
    return f"http://{ADDRESS}:{port}/simple/"


def start(root: Path, log: Path) -> tuple[int, int]:
    """Serve `root` on an ephemeral loopback port; returns (pid, port) once it listens."""
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", MODULE, str(root)], stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline().decode().strip() if ready else ""
    proc.stdout.close()
    if not line.isdigit():
        proc.kill()
        proc.wait()
        raise DeployError(f"the lab's package index did not start (exit {proc.poll()})", where=str(log),
                          hint="see the log; the index directory is " + str(root))
    return proc.pid, int(line)


def is_ours(pid: int, root: Path) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return MODULE.encode() in argv and str(root).encode() in argv


def alive(pid: int | None, root: Path) -> bool:
    return pid is not None and is_ours(pid, root)


def stop(pid: int | None, root: Path) -> None:
    if pid is None or not is_ours(pid, root):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and is_ours(pid, root):
        time.sleep(0.05)
    if is_ours(pid, root):
        os.kill(pid, signal.SIGKILL)


class _Quiet(SimpleHTTPRequestHandler):
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        return None  # pip fetches ~300 files per host; errors still reach the log through log_error


def main(argv: list[str] | None = None) -> int:
    (root,) = argv if argv is not None else sys.argv[1:]
    server = ThreadingHTTPServer((ADDRESS, 0), functools.partial(_Quiet, directory=root))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(server.server_address[1], flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the starter closed its end; later prints must not fail
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
