"""`export prometheus` scraped for real: a Prometheus (the distribution's package) on the controller reads the
exported targets and rules, finds every deployed lab instance up, evaluates the rule groups without error, and
holds the vLLM series the rules read for each instance (docs/observability.md). One instance has an API key,
which the scrape does without (vLLM guards only /v1 and its siblings) and which no file of the pack holds.

Reuses the session lab: every GPU host deployed at once (one instance each), cleaned before and after.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ernie_deploy.checks.progress import Thresholds
from ernie_deploy.cli.main import main
from ernie_deploy.export import prometheus as pack
from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import clean, wait_for
from lab.test_lab_deploy import write_inventory

pytestmark = pytest.mark.lab

HOST = "a10-2"  # two GPUs, one TP=2 instance with an API key: its tp label says 2
UP_WITHIN = 15.0
KEY = "key-" + secrets.token_hex(12)
# Series a rule reads that the simulated vLLM does not serve at the lab's version: the simulator writes
# prometheus_client's process collector families only in its 0.32.0 profile (lab/sim/vllm_metrics.py); real vLLM
# serves them (tests/fixtures/real-vllm/0.32.0/http/metrics.txt), and the restart rule still evaluates.
SIM_LACKS = {"process_start_time_seconds"}


def gpu_hosts(state: LabState) -> str:
    """The --limit of every vLLM host of the lab (its balancer stays out: HAProxy is another test's)."""
    return ",".join(h.name for h in state.hosts)


@pytest.fixture
def deployed(lab: Lab, lab_state: LabState, tmp_path: Path) -> Iterator[Path]:
    clean(lab, lab_state)
    inv = write_inventory(lab_state, tmp_path, **{HOST: {"vllm_api_key": KEY}})
    try:
        assert main(["deploy", "-i", str(inv), "--limit", gpu_hosts(lab_state), "--startup-budget", "60"]) == 0
        yield inv
    finally:
        clean(lab, lab_state)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def api(port: int, path: str, **query: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())["data"]


def test_a_real_prometheus_scrapes_every_instance_and_evaluates_the_rules(
        deployed: Path, lab_state: LabState, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus is not installed (apt-get install prometheus)"
    out = tmp_path / "pack"
    assert main(["export", "prometheus", "-i", str(deployed), "--limit", gpu_hosts(lab_state), "-o", str(out),
                 "--scrape-interval", "1"]) == 0
    assert all(KEY not in f.read_text() for f in out.rglob("*") if f.is_file())
    targets = json.loads((out / pack.TARGETS).read_text())
    instances = {t for entry in targets for t in entry["targets"]}
    labels = {entry["labels"]["host"]: entry["labels"] for entry in targets}
    assert set(labels) == {h.name for h in lab_state.hosts} and len(instances) == len(targets)
    assert labels[HOST]["tp"] == "2"
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([binary, f"--config.file={out / pack.CONFIG}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=sink)
    try:
        def all_up() -> bool:
            try:
                active = api(port, "targets")["activeTargets"]
            except OSError:
                return False
            return {t["labels"]["instance"] for t in active if t["health"] == "up"} == instances

        def evaluated() -> bool:
            rules = [r for g in api(port, "rules")["groups"] for r in g["rules"]]
            return bool(rules) and all(r["health"] == "ok" and not r["lastEvaluation"].startswith("0001")
                                       for r in rules)

        assert wait_for(all_up, UP_WITHIN, interval=0.5), log.read_text()[-2000:]
        assert wait_for(evaluated, UP_WITHIN, interval=0.5), api(port, "rules")
        used = {n for e in pack.rule_exprs(pack.rules({HOST: Thresholds()}, 1)) for n in pack.names_in(e)}
        assert used >= SIM_LACKS
        for name in sorted(used - {"up"} - SIM_LACKS):
            series = api(port, "query", query=f'{name}{{job="{pack.JOB}"}}')["result"]
            assert {s["metric"]["instance"] for s in series} == instances, name
            assert {s["metric"]["host"] for s in series} == set(labels), name
            assert all(s["metric"]["release"] for s in series), name
    finally:
        proc.terminate()
        proc.wait(timeout=10)
