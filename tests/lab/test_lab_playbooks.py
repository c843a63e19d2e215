"""Playbooks, status and logs on real hosts: site.yml takes bare hosts to verified services, a second run
changes and restarts nothing, --check changes nothing, --tags and --limit narrow what runs; status finds each
kind of hand-made drift and deploy clears it; logs shows an instance's current run.

A lab of its own (two bare hosts from 127.0.0.71) beside the session's lab, torn down at the end. The tests
run in file order and build on each other, as an operator's day does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from ernie_deploy.lab.spec import parse_spec
from lab.labhelpers import wait_for

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
SITE = str(ROOT / "playbooks/site.yml")
UNIT = "ernie-vllm-0.service"


@pytest.fixture(scope="module")
def book_lab(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Needs the session lab only to know the machine can run one."""
    spec = parse_spec({"first_address": "127.0.0.71", "hosts": [
        {"name": "p1", "gpu_model": "NVIDIA A10", "gpu_count": 1, "bare": True},
        {"name": "p2", "gpu_model": "NVIDIA A10", "gpu_count": 2, "bare": True},
    ]})
    the_lab = Lab(tmp_path_factory.mktemp("booklab"), progress=lambda m: sys.stderr.write(f"[booklab] {m}\n"))
    try:
        the_lab.up(spec)
        yield the_lab
    finally:
        the_lab.down()


@pytest.fixture(scope="module")
def inv(book_lab: Lab) -> str:
    state: LabState = book_lab.require_state()
    return state.inventory


def cli(capsys: pytest.CaptureFixture[str], inv: str, lab: Lab, *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*argv, "-i", inv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def sh(lab: Lab, host: str, command: str) -> str:
    done = lab.ssh(host, command)
    assert done.returncode == 0, done.stderr
    return done.stdout


def invocations(lab: Lab) -> dict[str, str]:
    return {h: sh(lab, h, f"systemctl show -p InvocationID --value {UNIT}").strip() for h in ("p1", "p2")}


def host_state(lab: Lab) -> dict[str, str]:
    return {h: sh(lab, h, "ls -A /opt/vllm /etc/systemd/system /models 2>&1; getent passwd vllm || true")
            for h in ("p1", "p2")}


def test_check_on_bare_hosts_changes_nothing(capsys: pytest.CaptureFixture[str], book_lab: Lab, inv: str) -> None:
    before = host_state(book_lab)
    rc, doc = cli(capsys, inv, book_lab, "run", SITE, "--check")
    # Bare hosts cannot be planned before they are provisioned for real, so the plan task fails; nothing moved.
    assert rc in (0, 2), doc
    assert [t["action"] for t in doc["tasks"]][:1] == ["provision"]
    assert all(any("would change" in e for e in h["evidence"]) for h in doc["tasks"][0]["hosts"]), doc["tasks"][0]
    assert host_state(book_lab) == before


def test_site_takes_bare_hosts_to_verified_services(capsys: pytest.CaptureFixture[str], book_lab: Lab,
                                                    inv: str) -> None:
    rc, doc = cli(capsys, inv, book_lab, "run", SITE)
    assert rc == 0, [(t["task"], h["host"], h["message"]) for t in doc["tasks"] for h in t["hosts"]]
    assert [t["action"] for t in doc["tasks"]] == ["provision", "plan", "converge", "rolling", "verify"]
    verify = doc["tasks"][-1]["hosts"]
    assert {h["host"] for h in verify} == {"p1", "p2"}
    for h in verify:
        assert h["status"] == "ok" and h["checks"] and all(c["status"] != "fail" for c in h["checks"])
        (tp,) = [c for c in h["checks"] if c["name"] == "tensor_parallel"]
        assert f"Using tensor parallel size {1 if h['host'] == 'p1' else 2}" in tp["summary"]
    rolling = doc["tasks"][3]["hosts"]
    assert {h["host"]: h["batch"] for h in rolling} == {"p1": 1, "p2": 2}  # the canary first, alone


def test_a_second_run_changes_and_restarts_nothing(capsys: pytest.CaptureFixture[str], book_lab: Lab,
                                                   inv: str) -> None:
    before = invocations(book_lab)
    rc, doc = cli(capsys, inv, book_lab, "run", SITE)
    assert rc == 0
    assert {h: c["changed"] for h, c in doc["recap"].items()} == {"p1": 0, "p2": 0}
    assert invocations(book_lab) == before
    rc, doc = cli(capsys, inv, book_lab, "run", SITE, "--check")
    assert rc == 0 and all(c["changed"] == 0 for c in doc["recap"].values())
    assert invocations(book_lab) == before


def test_tags_and_limit_narrow_what_runs(capsys: pytest.CaptureFixture[str], book_lab: Lab, inv: str) -> None:
    rc, doc = cli(capsys, inv, book_lab, "run", SITE, "--tags", "verify")
    assert rc == 0 and [t["action"] for t in doc["tasks"]] == ["verify"]
    rc, doc = cli(capsys, inv, book_lab, "run", SITE, "--limit", "p1", "--skip-tags", "provision")
    assert rc == 0
    assert [t["action"] for t in doc["tasks"]] == ["plan", "converge", "rolling", "verify"]
    assert all([h["host"] for h in t["hosts"]] == ["p1"] for t in doc["tasks"])


def test_status_finds_hand_made_drift_and_deploy_clears_it(capsys: pytest.CaptureFixture[str], book_lab: Lab,
                                                            inv: str) -> None:
    rc, doc = cli(capsys, inv, book_lab, "status")
    assert rc == 0 and all(h["drift"] == [] for h in doc["hosts"].values()), doc
    assert all(h["release"] and h["last_change"] and h["lock"] is None for h in doc["hosts"].values())
    # A unit edited by hand and restarted (p2), an env file changed but not restarted (p1).
    sh(book_lab, "p2", f"sed -i 's/--max-model-len 4096/--max-model-len 2048/' /etc/systemd/system/{UNIT} && "
                       f"systemctl daemon-reload && systemctl restart {UNIT}")
    sh(book_lab, "p1", "sleep 2; echo VLLM_LOGGING_LEVEL=DEBUG >> /etc/ernie-deploy/ernie-vllm-0.env")
    assert wait_for(lambda: "Application startup complete." in sh(
        book_lab, "p2", f"journalctl -u {UNIT} -n 3 -o cat --no-pager"), timeout=60)
    rc, doc = cli(capsys, inv, book_lab, "status")
    kinds = {h: {d["kind"] for d in doc["hosts"][h]["drift"]} for h in ("p1", "p2")}
    assert rc == 2 and kinds == {"p1": {"file", "not-applied"}, "p2": {"file", "cmdline"}}, doc
    (cmdline,) = [d for d in doc["hosts"]["p2"]["drift"] if d["kind"] == "cmdline"]
    assert "--max-model-len 2048" in cmdline["message"] and "deploy" in cmdline["fix"] and "p2" in cmdline["fix"]
    # An edit the process has not seen: the unit file with NeedDaemonReload, without a restart.
    sh(book_lab, "p2", f"sleep 2; echo '# hand edit' >> /etc/systemd/system/{UNIT}")
    rc, doc = cli(capsys, inv, book_lab, "status", "--limit", "p2")
    assert "daemon-reload" in {d["kind"] for d in doc["hosts"]["p2"]["drift"]}
    assert main(["deploy", "-i", inv]) == 0
    rc, doc = cli(capsys, inv, book_lab, "status")
    assert rc == 0 and all(h["drift"] == [] for h in doc["hosts"].values()), doc


def test_status_names_a_process_started_by_hand(capsys: pytest.CaptureFixture[str], book_lab: Lab,
                                                inv: str) -> None:
    argv = sh(book_lab, "p1", f"tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value {UNIT})/cmdline")
    words = argv.split()[1:]  # the script and its arguments, without the interpreter
    sh(book_lab, "p1", f"systemctl stop {UNIT}; CUDA_VISIBLE_DEVICES=0 setsid nohup {' '.join(words)} "
                       ">/tmp/by-hand.log 2>&1 < /dev/null & echo $! > /tmp/by-hand.pid")
    rc, doc = cli(capsys, inv, book_lab, "status", "--limit", "p1")
    drift = {d["kind"]: d for d in doc["hosts"]["p1"]["drift"]}
    assert rc == 2 and {"process", "down"} <= set(drift), doc
    pid = sh(book_lab, "p1", "cat /tmp/by-hand.pid").strip()
    assert drift["process"]["subject"] == pid and f"kill {pid}" in drift["process"]["fix"]
    sh(book_lab, "p1", f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.2; done")
    assert main(["deploy", "-i", inv, "--limit", "p1"]) == 0
    rc, doc = cli(capsys, inv, book_lab, "status", "--limit", "p1")
    assert rc == 0 and doc["hosts"]["p1"]["drift"] == []


def test_logs_shows_the_current_run_and_the_previous(capsys: pytest.CaptureFixture[str], book_lab: Lab,
                                                     inv: str) -> None:
    capsys.readouterr()
    assert main(["logs", "-i", inv, "p1", "-n", "400"]) == 0
    current = capsys.readouterr()
    assert "Application startup complete." in current.out
    now = sh(book_lab, "p1", f"systemctl show -p InvocationID --value {UNIT}").strip()
    assert now in current.err
    assert main(["logs", "-i", inv, "p1", "--previous"]) == 0
    previous = capsys.readouterr()
    assert now not in previous.err and "previous" in previous.err
