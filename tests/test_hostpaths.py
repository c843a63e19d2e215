"""Host paths and the loopback rule have one owner (planning/hostpaths.py), which the remote scripts, the on-host
programs and the exported role's host program all use."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ernie_deploy.export.program import host_program
from ernie_deploy.planning import hostpaths
from ernie_deploy.planning.hostpaths import local_url, loopback
from ernie_deploy.remote import http
from ernie_deploy.remote.programs import program

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("bind", "port", "url"), [
    ("0.0.0.0", 8000, "http://127.0.0.1:8000"),  # IPv4 wildcard: IPv4 loopback
    ("", 8000, "http://127.0.0.1:8000"),  # vLLM's default: all IPv4 addresses
    ("::", 8001, "http://[::1]:8001"),  # IPv6 wildcard: an IPv6-only socket never answers on 127.0.0.1
    ("10.0.0.5", 8002, "http://10.0.0.5:8002"),  # a specific address: the only one it answers on
    ("fd00::5", 8003, "http://[fd00::5]:8003"),
    ("gpu-a10-01.dc1", 8004, "http://gpu-a10-01.dc1:8004"),  # a name: as given
])
def test_one_loopback_rule(bind: str, port: int, url: str) -> None:
    assert local_url(bind, port) == url
    assert loopback(bind) in url


def test_the_on_host_programs_carry_the_rule_not_an_import() -> None:
    text = program("http_probe")
    assert "ernie_deploy" not in text and "def loopback(" in text and "def local_url(" in text
    assert text.index("def loopback(") < text.index("def local_url(")  # defined before its use
    compile(text, "http_probe", "exec")


def test_health_reads_reach_a_wildcard_bind_on_loopback() -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = subprocess.run([sys.executable, "-c", http.PROGRAM, "ernie-vllm-0.service", "0.0.0.0",
                              str(server.server_address[1]), "ernie-vllm-1.service", "127.0.0.1", "1"],
                             capture_output=True, text=True, timeout=30, check=True)
    finally:
        server.shutdown()
    lines = out.stdout.splitlines()
    assert lines[0] == "ernie-vllm-0.service 200" and lines[1].startswith("ernie-vllm-1.service error ")


def test_the_exported_host_program_uses_the_same_paths() -> None:
    spec = importlib.util.spec_from_file_location("ernie_host_paths", ROOT / "ernie_deploy/export/hostscript.py")
    assert spec is not None and spec.loader is not None
    raw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(raw)
    shipped: dict[str, object] = {}
    exec(compile(host_program(()), "ernie_host.py", "exec"), shipped)
    for name in hostpaths.EXPORTED:
        assert getattr(raw, name) == shipped[name] == getattr(hostpaths, name), name
