"""Provisioning bare lab hosts for real: the driver check, the service user, a real venv + pip install of the
simulator wheel, the model copy over SSH (resumed after an interrupt, a changed file replaced), a version
change that waits for the next restart, and an index URL whose credentials never show.

A lab of its own (two bare hosts from 127.0.0.61) beside the session's lab, torn down at the end.
"""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from ernie_deploy.lab.spec import parse_spec
from lab.labhelpers import wait_for

pytestmark = pytest.mark.lab

MODEL = "/models/ERNIE-4.5-0.3B-PT"
WEIGHTS = f"{MODEL}/model.safetensors"


@pytest.fixture(scope="module")
def prov(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Needs the session lab only to know the machine can run one."""
    spec = parse_spec({"first_address": "127.0.0.61", "hosts": [
        {"name": "fresh", "gpu_model": "NVIDIA A10", "gpu_count": 1, "bare": True},
        # Below 0.34.0's minimum (580.65.06, docs/drivers.md).
        {"name": "old-driver", "gpu_model": "NVIDIA A10", "gpu_count": 1, "bare": True,
         "driver_version": "535.104.05", "cuda_version": "12.2"},
    ]})
    the_lab = Lab(tmp_path_factory.mktemp("provlab"), progress=lambda m: sys.stderr.write(f"[provlab] {m}\n"))
    try:
        the_lab.up(spec)
        yield the_lab
    finally:
        the_lab.down()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def inventory(state: LabState, tmp_path: Path, **changes: Any) -> str:
    """The lab's inventory with group vars changed (None removes one)."""
    data = yaml.safe_load(Path(state.inventory).read_text())
    group_vars = data["all"]["children"]["lab"]["vars"]
    for key, value in changes.items():
        if value is None:
            group_vars.pop(key, None)
        else:
            group_vars[key] = value
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def sh(lab: Lab, host: str, command: str) -> str:
    done = lab.ssh(host, command)
    assert done.returncode == 0, done.stderr
    return done.stdout


def source_sha(state: LabState, name: str = "model.safetensors") -> str:
    return hashlib.sha256((Path(state.dir) / "model-source/ERNIE-4.5-0.3B-PT" / name).read_bytes()).hexdigest()


def test_old_driver_fails_the_host_before_anything_is_installed(capsys: pytest.CaptureFixture[str],
                                                              prov: Lab) -> None:
    state = prov.require_state()
    rc, doc = run(capsys, "provision", "-i", state.inventory, "--limit", "old-driver")
    host = doc["hosts"]["old-driver"]
    assert rc == 2 and host["status"] == "failed"
    assert "535.104.05" in host["error"] and "580.65.06" in host["error"], host["error"]
    assert "nothing was installed" in host["error"] and "upgrade the NVIDIA driver" in host["hint"]
    left = sh(prov, "old-driver", "ls /opt/vllm /models 2>&1; id vllm 2>&1; ls /var/lib/ernie-deploy")
    assert "No such file" in left and "no such user" in left and "lock" not in left, left


def test_bare_host_provision_deploy_verify_then_a_second_run_changes_nothing(capsys: pytest.CaptureFixture[str],
                                                                            prov: Lab) -> None:
    state = prov.require_state()
    rc, doc = run(capsys, "provision", "-i", state.inventory, "--limit", "fresh")
    host = doc["hosts"]["fresh"]
    assert rc == 0 and host["status"] == "changed", host
    steps = {a["step"]: a["status"] for a in host["actions"]}
    assert steps == {"driver": "ok", "service user": "changed", "prerequisites": "ok", "vllm": "changed",
                     "model": "changed"}, host["actions"]
    assert host["model"]["sent_bytes"] == host["model"]["bytes"] > 4_000_000
    # Real pip metadata, the service user without a login shell, files it owns, every change audited.
    assert sh(prov, "fresh", "/opt/vllm/0.34.0/bin/python -m pip show vllm | sed -n 's/^Version: //p'").strip() \
        == "0.34.0"
    assert sh(prov, "fresh", "getent passwd vllm | cut -d: -f7").strip() == "/usr/sbin/nologin"
    assert sh(prov, "fresh", f"stat -c '%U %a' {WEIGHTS}").split() == ["vllm", "644"]
    assert sh(prov, "fresh", f"sha256sum {WEIGHTS}").split()[0] == source_sha(state)
    audit = [json.loads(line) for line in sh(prov, "fresh", "cat /var/log/ernie-deploy/audit.log").splitlines()]
    assert [a["step"] for a in audit if a.get("action") == "provision"] == \
        ["create user", "switch wheelhouse", "install vllm", "switch model"]

    assert main(["deploy", "-i", state.inventory, "--limit", "fresh"]) == 0
    assert main(["verify", "-i", state.inventory, "--limit", "fresh"]) == 0

    rc, doc = run(capsys, "provision", "-i", state.inventory, "--limit", "fresh")
    again = doc["hosts"]["fresh"]
    assert rc == 0 and again["status"] == "ok" and {a["status"] for a in again["actions"]} == {"ok"}, again
    assert again["commands"] == 2  # the probe (with the lock), and releasing the lock
    assert len(sh(prov, "fresh", "cat /var/log/ernie-deploy/audit.log").splitlines()) > len(audit)  # deploy's
    rc, doc = run(capsys, "provision", "-i", state.inventory, "--limit", "fresh", "--check")
    assert rc == 0 and doc["hosts"]["fresh"]["commands"] == 1


def test_a_file_changed_on_the_host_is_detected_and_replaced(capsys: pytest.CaptureFixture[str], prov: Lab) -> None:
    state = prov.require_state()
    # Same size, different bytes: the recorded mtime no longer matches, so it is not trusted.
    sh(prov, "fresh", f"printf 'XXXX' | dd of={WEIGHTS} bs=1 seek=100 conv=notrunc status=none")
    assert sh(prov, "fresh", f"sha256sum {WEIGHTS}").split()[0] != source_sha(state)
    rc, doc = run(capsys, "provision", "-i", state.inventory, "--limit", "fresh")
    model = doc["hosts"]["fresh"]["model"]
    assert rc == 0 and model["send_files"] == 1 and model["sent_bytes"] == model["send_bytes"]
    assert sh(prov, "fresh", f"sha256sum {WEIGHTS}").split()[0] == source_sha(state)
    # --verify-files re-hashes on the host: everything matches now, so nothing is sent.
    rc, doc = run(capsys, "provision", "-i", state.inventory, "--limit", "fresh", "--verify-files")
    assert rc == 0 and doc["hosts"]["fresh"]["model"]["send_files"] == 0


def test_an_interrupted_copy_is_resumed_and_verified(prov: Lab, tmp_path: Path) -> None:
    state = prov.require_state()
    target = "/models/resume-test"
    inv = inventory(state, tmp_path, vllm_model=target)
    part_sizes = f"find {target}.ernie-staging -name '*.part' -printf '%s\\n' 2>/dev/null"
    # 4 MiB at 1 MiB/s: Ctrl-C lands half way.
    proc = subprocess.Popen([sys.executable, "-m", "ernie_deploy", "provision", "-i", inv, "--limit", "fresh",
                             "--bwlimit", "1M"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: int((prov.ssh("fresh", part_sizes).stdout.split() or ["0"])[0]) > 500_000, 30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = int(sh(prov, "fresh", part_sizes).split()[0])
    assert 0 < partial < 4 * 1024 * 1024
    assert sh(prov, "fresh", f"ls {target} 2>&1 || true").strip().endswith("No such file or directory")
    assert sh(prov, "fresh", "ls /var/lib/ernie-deploy").split().count("lock") == 0  # released on Ctrl-C
    again = subprocess.run([sys.executable, "-m", "ernie_deploy", "provision", "-i", inv, "--limit", "fresh",
                                  "--json"], capture_output=True, text=True, timeout=120)
    model = json.loads(again.stdout)["hosts"]["fresh"]["model"]
    assert again.returncode == 0 and model["resumed_bytes"] >= partial, model
    assert model["sent_bytes"] < model["bytes"]
    assert sh(prov, "fresh", f"sha256sum {target}/model.safetensors").split()[0] == source_sha(state)
    assert sh(prov, "fresh", f"ls -d {target}.ernie-staging 2>&1 || true").strip().endswith("No such file or directory")


def test_a_version_change_installs_beside_and_switches_at_the_next_restart(capsys: pytest.CaptureFixture[str],
                                                                         prov: Lab, tmp_path: Path) -> None:
    state = prov.require_state()
    data = yaml.safe_load(Path(state.inventory).read_text())
    data["all"]["children"]["lab"]["hosts"]["fresh"]["vllm_version"] = "0.33.0"
    inv = tmp_path / "inventory.yml"
    inv.write_text(yaml.safe_dump(data))
    version = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.61:8000/version')" \
              ".read().decode())\""
    assert json.loads(sh(prov, "fresh", version))["version"] == "0.34.0"
    rc, doc = run(capsys, "provision", "-i", str(inv), "--limit", "fresh")
    assert rc == 0 and [a["step"] for a in doc["hosts"]["fresh"]["actions"] if a["status"] == "changed"] == ["vllm"]
    assert sh(prov, "fresh", "ls /opt/vllm").split() == ["0.33.0", "0.34.0"]
    pid = sh(prov, "fresh", "systemctl show -p MainPID --value ernie-vllm-0").strip()
    assert json.loads(sh(prov, "fresh", version))["version"] == "0.34.0"  # nothing restarted under it
    assert main(["deploy", "-i", str(inv), "--limit", "fresh"]) == 0  # the unit names the new venv: a restart
    assert sh(prov, "fresh", "systemctl show -p MainPID --value ernie-vllm-0").strip() != pid
    assert json.loads(sh(prov, "fresh", version))["version"] == "0.33.0"
    assert "/opt/vllm/0.33.0/bin/vllm serve" in sh(prov, "fresh", "cat /etc/systemd/system/ernie-vllm-0.service")
    # The old venv stays: the kept releases still run it on a rollback.
    assert sh(prov, "fresh", "ls /opt/vllm").split() == ["0.33.0", "0.34.0"]


def _index_server(wheels: Path, user: str, password: str) -> tuple[ThreadingHTTPServer, list[str]]:
    """A PEP 503 simple index of the lab wheelhouse behind basic auth; records the Authorization headers."""
    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization") or "")
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="lab"')
                self.end_headers()
                return
            if self.path.rstrip("/") == "/simple/vllm":
                links = "".join(f'<a href="/files/{w.name}">{w.name}</a>\n' for w in sorted(wheels.glob("*.whl")))
                body = f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode()
                kind = "text/html"
            elif self.path.startswith("/files/") and (wheels / self.path[7:]).is_file():
                body = (wheels / self.path[7:]).read_bytes()
                kind = "application/octet-stream"
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_an_index_url_with_credentials_never_shows(capsys: pytest.CaptureFixture[str], prov: Lab,
                                                   tmp_path: Path) -> None:
    state = prov.require_state()
    password = "Pr0v1s10nS3cret"
    server, seen = _index_server(Path(state.dir) / "wheelhouse", "ops", password)
    try:
        url = f"http://ops:{password}@127.0.0.1:{server.server_address[1]}/simple/"
        data = yaml.safe_load(Path(state.inventory).read_text())
        data["all"]["children"]["lab"]["hosts"]["fresh"]["vllm_version"] = "0.27.1"
        group_vars = data["all"]["children"]["lab"]["vars"]
        group_vars.pop("vllm_pip_find_links")
        group_vars["vllm_pip_index_url"] = url
        inv = tmp_path / "inventory.yml"
        inv.write_text(yaml.safe_dump(data))
        capsys.readouterr()
        rc = main(["provision", "-i", str(inv), "--limit", "fresh", "--json", "-vv"])
        out, err = capsys.readouterr()
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0, out
    assert any(h.startswith("Basic ") for h in seen)  # pip really used the index, credentials and all
    assert sh(prov, "fresh", "/opt/vllm/0.27.1/bin/vllm --version").strip() == "0.27.1"
    host_side = sh(prov, "fresh", "cat /var/log/ernie-deploy/audit.log; journalctl -q --no-pager -o cat; "
                                  "cat /opt/vllm/0.27.1/pyvenv.cfg")
    for text in (out, err, host_side):
        assert password not in text
