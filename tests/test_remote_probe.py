"""Probe scripts and their parsers: HTTP made on the host (one network door), systemd and journal sections."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ernie_deploy.planning.hostpaths import local_url
from ernie_deploy.remote import http, probe


def test_probe_program_runs_and_answers_in_order() -> None:
    """The host-side program, run here with this python, against a real local HTTP server."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(f"GET {self.path} {self.headers.get('authorization')}")
            self.send_response(200 if self.path == "/health" else 401)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = local_url("127.0.0.1", server.server_address[1])
        requests = [http.Request("h", f"{base}/health"), http.Request("m", f"{base}/v1/models", auth=True, after="h"),
                    http.Request("x", f"{base}/none", after="m")]
        out = subprocess.run([sys.executable, "-c", http.PROGRAM], input=http.stdin(requests, "sk-secret"),
                             capture_output=True, timeout=30, check=True)
    finally:
        server.shutdown()
    answers = http.parse(out.stdout.decode())
    assert answers["h"].status == 200 and answers["m"].status == 401 and "x" not in answers  # x needs m's 200
    assert seen == ["GET /health None", "GET /v1/models Bearer sk-secret"]
    assert "sk-secret" not in http.script() and "sk-secret" not in http.PROGRAM  # the key travels on stdin only


def test_wildcard_bind_is_probed_on_loopback() -> None:
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert local_url("::", 8000) == "http://[::1]:8000"
    assert local_url("10.0.0.5", 8001) == "http://10.0.0.5:8001"


def test_probe_parse_sections_and_missing_python() -> None:
    answer = {"id": "u health", "status": 200, "error": None, "seconds": 0.1, "first_byte": 0.05,
              "body": base64.b64encode(b"ok").decode()}
    text = ("@@ernie-deploy:http\n" + http.MARK + json.dumps(answer) + "\n"
            "@@ernie-deploy:unit u.service\nId=u.service\nActiveState=active\nSubState=running\nNRestarts=1\n"
            "MainPID=42\n@@ernie-deploy:journal u.service\nline one\n-- cursor: s=abc\n"
            "@@ernie-deploy:gpus\n0, GPU-0, 1, 2, 3\n@@ernie-deploy:ps\n42 1\n")
    seen = probe.parse(text)
    unit = seen.unit("u.service")
    assert unit.state.active_state == "active" and unit.state.n_restarts == 1 and unit.state.main_pid == 42
    assert unit.journal == ["line one"] and unit.cursor == "s=abc"
    assert seen.http["u health"].body == b"ok" and seen.gpus == "0, GPU-0, 1, 2, 3" and seen.ps == "42 1"
    nopy = http.parse(http.MARK + '{"id": "*", "error": "python3 not found on the host"}')
    assert http.missing(nopy, "u health").error == "python3 not found on the host"


def test_probe_command_carries_the_key_on_stdin_only() -> None:
    cmd = probe.host_command(["u.service"], [http.Request("u health", "http://127.0.0.1:1/health", auth=True)],
                             "sk-secret")
    assert "sk-secret" not in cmd.script and b"sk-secret" in cmd.stdin
    assert cmd.script.index("@@ernie-deploy:http") < cmd.script.index("@@ernie-deploy:unit")


def test_watch_script_passes_the_cursor_to_journalctl_exactly(tmp_path: Path) -> None:
    """Run the real script with stand-in systemctl/journalctl: the cursor must arrive as one argument, unquoted
    (a quoted cursor makes journalctl fail to seek, and the watch then sees no new line at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text('#!/bin/sh\ncase "$*" in *--value*) echo run-1;; *) echo Id=u.service;; esac\n')
    (bin_dir / "journalctl").write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"ARG:$a\"; done\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    cursor = "s=abc;i=1d7;b=12;m=14;t=66;x=7d"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def args(invocation: str) -> list[str]:
        cmd = probe.watch_command("u.service", invocation=invocation, cursor=cursor, requests=[], api_key=None)
        out = subprocess.run(["sh", "-c", cmd.script], capture_output=True, text=True, env=env, check=True).stdout
        return [line[4:] for line in out.splitlines() if line.startswith("ARG:")]

    same_run = args("run-1")
    assert f"--after-cursor={cursor}" in same_run
    assert "_SYSTEMD_INVOCATION_ID=run-1" in same_run and "INVOCATION_ID=run-1" in same_run
    new_run = args("run-0")  # systemd restarted it since: read the new run from its first line
    assert not [a for a in new_run if a.startswith("--after-cursor")]
