"""`export ansible` run for real: ansible-playbook (and ansible-runner's transmit | worker | process, the path
AWX's execution nodes take) against lab hosts. The units that land equal `render`'s byte for byte, a second
run changes nothing, ernie-deploy's verify, deploy, releases and status agree with what Ansible did, the two
share the deploy lock, a rolling restart under load with the balancer hooks loses no request, the export's own
balancer role and cycle drive a real HAProxy (the session lab's lb-1) through a rolling restart without losing a
request, and a start-up fault ends the play after its batch with that host back on the release it ran.

A lab of its own (three ready hosts from 127.0.0.61) beside the session's lab, torn down at the end; the session
lab lends its balancer host, put back as the image left it afterwards. The tests run in file order and build on
each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import BalancerSpec, Lab, LabState
from ernie_deploy.lab.access import BALANCER_GROUP, balancer_group
from ernie_deploy.lab.spec import parse_spec
from ernie_deploy.remote.lock import LockInfo, acquire_script, release_script
from lab.haproxy import LabBalancer, StateSampler, drained_then_ready
from lab.labhelpers import wait_for
from lab.loadgen import LoadBalancer, Sampler, hook, through
from lab.test_lab_balancer import BALANCER, RESET, SAVED, UP_WITHIN

pytestmark = pytest.mark.lab

HOSTS = ("x1", "x2", "x3")
FAULTS = "/etc/ernie-lab/faults.json"
QUICK = {"load_seconds": 1}
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RECAP = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


@pytest.fixture(scope="module")
def xlab(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Needs the session lab only to know the machine can run one."""
    spec = parse_spec({"first_address": "127.0.0.61", "hosts": [
        {"name": "x1", "gpu_model": "NVIDIA A10", "gpu_count": 1},
        {"name": "x2", "gpu_model": "NVIDIA A10", "gpu_count": 2},
        {"name": "x3", "gpu_model": "NVIDIA A10", "gpu_count": 1},
    ]})
    the_lab = Lab(tmp_path_factory.mktemp("xlab"), progress=lambda m: print(f"[xlab] {m}", file=sys.stderr))
    try:
        the_lab.up(spec)
        for host in HOSTS:
            the_lab.ssh(host, f"mkdir -p /etc/ernie-lab && cat > {FAULTS}", input=json.dumps(QUICK))
        yield the_lab
    finally:
        the_lab.down()


@pytest.fixture(scope="module")
def secret_values() -> dict[str, str]:
    return {"vllm_api_key": "key-" + secrets.token_hex(12), "hf_token": "hf_" + secrets.token_hex(12)}


def write_inventory(state: LabState, path: Path, values: dict[str, str], **host_vars: dict[str, Any]) -> Path:
    data = yaml.safe_load(Path(state.inventory).read_text())
    data["all"]["children"]["lab"]["vars"].update(values)
    for host, extra in host_vars.items():
        data["all"]["children"]["lab"]["hosts"][host].update(extra)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def inv(xlab: Lab, secret_values: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inventory(xlab.require_state(), tmp_path_factory.mktemp("xinv") / "inventory.yml", secret_values)


def export(inv: Path, out: Path, values: dict[str, str], *extra: str) -> Path:
    assert main(["export", "ansible", "-i", str(inv), "-o", str(out), *extra]) == 0
    # What an operator keeps in an ansible-vault file (encrypted there; plain here, outside the export).
    (out.parent / f"{out.name}-vault.yml").write_text(yaml.safe_dump(
        {f"vault_{k}": v for k, v in values.items()}))
    return out


@pytest.fixture(scope="module")
def exported(inv: Path, secret_values: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(inv, tmp_path_factory.mktemp("exports") / "ansible", secret_values)


def playbook(directory: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_CONFIG": str(directory / "ansible.cfg")}
    vault = directory.parent / f"{directory.name}-vault.yml"
    return subprocess.run([str(BIN / "ansible-playbook"), name, "-e", f"@{vault}", *extra], cwd=directory,
                          env=env, capture_output=True, text=True, timeout=600, check=False)


def recap(out: str) -> dict[str, dict[str, int]]:
    plain = ANSI.sub("", out)  # runner's process side replays the worker's coloured output
    return {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
            for m in RECAP.finditer(plain)}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def rendered(inv: Path, out: Path) -> dict[str, dict[str, str]]:
    """Host → unit path → sha256 of what `ernie-deploy render` writes."""
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 0
    return {host: {f"/etc/systemd/system/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
                   for p in (out / host / "etc/systemd/system").glob("*.service")} for host in HOSTS}


def on_host(xlab: Lab, host: str, paths: list[str]) -> dict[str, str]:
    out = xlab.ssh(host, "sha256sum " + " ".join(paths)).stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def invocations(xlab: Lab) -> dict[str, str]:
    return {h: xlab.ssh(h, "for u in /etc/systemd/system/ernie-vllm-*.service; do "
                           "systemctl show -p InvocationID --value $(basename $u); done").stdout for h in HOSTS}


def test_export_holds_no_secret_and_passes_the_syntax_check(exported: Path, secret_values: dict[str, str]) -> None:
    everything = b"".join(p.read_bytes() for p in exported.rglob("*") if p.is_file())
    for value in secret_values.values():
        assert value.encode() not in everything
    inventory = (exported / "inventory.yml").read_text()
    assert "{{ vault_vllm_api_key }}" in inventory and "{{ vault_hf_token }}" in inventory
    env = (exported / "roles/ernie_vllm/templates/hosts/x1/ernie-vllm-0.env.j2").read_text()
    assert "VLLM_API_KEY='{{ vllm_api_key }}'" in env and "HF_TOKEN='{{ hf_token }}'" in env
    for name in ("site.yml", "rolling-restart.yml", "verify.yml"):
        done = playbook(exported, name, "--syntax-check")
        assert done.returncode == 0, done.stdout + done.stderr


def test_site_deploys_units_equal_to_render_and_ernie_deploy_agrees(
        capsys: pytest.CaptureFixture[str], xlab: Lab, inv: Path, exported: Path, tmp_path: Path) -> None:
    done = playbook(exported, "site.yml")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr
    assert all(r["failed"] == 0 and r["changed"] > 0 for r in recap(done.stdout).values()), done.stdout[-3000:]
    for host, units in rendered(inv, tmp_path / "render").items():
        assert on_host(xlab, host, sorted(units)) == units, host
    rc, doc = cli(capsys, "verify", "-i", str(inv))
    assert rc == 0, doc
    # ernie-deploy right after Ansible: nothing to change, and the release Ansible recorded is the current one.
    rc, doc = cli(capsys, "deploy", "-i", str(inv))
    assert rc == 0 and all(h["status"] == "ok" for h in doc["hosts"]), doc
    rc, doc = cli(capsys, "releases", "-i", str(inv))
    assert rc == 0, doc
    text = json.dumps(doc)
    assert "ansible-playbook site.yml" in text, text[:3000]
    rc, doc = cli(capsys, "status", "-i", str(inv))
    assert rc == 0, doc


def test_second_run_changes_nothing(xlab: Lab, exported: Path) -> None:
    before = invocations(xlab)
    done = playbook(exported, "site.yml")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr
    assert {h: r["changed"] for h, r in recap(done.stdout).items()} == dict.fromkeys(HOSTS, 0), done.stdout[-3000:]
    assert invocations(xlab) == before


def test_check_diff_shows_a_changed_unit_and_changes_nothing(xlab: Lab, inv: Path, secret_values: dict[str, str],
                                                             tmp_path: Path) -> None:
    changed = write_inventory(xlab.require_state(), tmp_path / "changed.yml", secret_values,
                              x1={"vllm_max_model_len": 2048})
    out = export(changed, tmp_path / "changed", secret_values)
    before = {h: on_host(xlab, h, ["/etc/systemd/system/ernie-vllm-0.service"]) for h in HOSTS}
    running = invocations(xlab)
    done = playbook(out, "site.yml", "--check", "--diff")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr
    assert "+ExecStart=" in done.stdout and "--max-model-len 2048" in done.stdout, done.stdout[-4000:]
    assert recap(done.stdout)["x1"]["changed"] > 0 and recap(done.stdout)["x2"]["changed"] == 0
    assert secret_values["vllm_api_key"] not in done.stdout  # env files are not diffed
    assert {h: on_host(xlab, h, ["/etc/systemd/system/ernie-vllm-0.service"]) for h in HOSTS} == before
    assert invocations(xlab) == running


def test_the_awx_path_transmit_worker_process(exported: Path, tmp_path: Path) -> None:
    """ansible-runner's streaming pipeline, as AWX runs a job on an execution node: changed=0 on a deployed lab."""
    pdd = tmp_path / "pdd"
    (pdd / "env").mkdir(parents=True)
    (pdd / "inventory").mkdir()
    subprocess.run(["cp", "-a", str(exported), str(pdd / "project")], check=True)
    (pdd / "inventory" / "hosts.yml").write_text((exported / "inventory.yml").read_text())
    vault = yaml.safe_load((exported.parent / f"{exported.name}-vault.yml").read_text())
    (pdd / "env" / "extravars").write_text(json.dumps(vault))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    runner = str(BIN / "ansible-runner")
    pipeline = (f"{runner} transmit {pdd} -p site.yml | {runner} worker | {runner} process {pdd}")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    stats = recap(done.stdout)
    assert {h: r["changed"] for h, r in stats.items()} == dict.fromkeys(HOSTS, 0), done.stdout[-3000:]
    # The job events the process side stored, as AWX stores them: the stats event says nothing changed.
    events = [json.loads(p.read_text()) for p in (pdd / "artifacts").rglob("job_events/*.json")]
    (stats_event,) = [e for e in events if e.get("event") == "playbook_on_stats"]
    assert stats_event["event_data"]["changed"] == {} and stats_event["event_data"]["failures"] == {}
    assert sorted(stats_event["event_data"]["ok"]) == list(HOSTS)


def test_a_held_ernie_deploy_lock_fails_that_host_naming_the_holder(xlab: Lab, exported: Path) -> None:
    holder = LockInfo.mine("ernie-deploy restart -i fleet.yml")
    assert xlab.ssh("x1", acquire_script(holder)).returncode == 0
    try:
        done = playbook(exported, "site.yml", "--limit", "x1")
    finally:
        xlab.ssh("x1", release_script(holder.token))
    assert done.returncode != 0
    assert "deploy lock held by" in done.stdout and "ernie-deploy restart -i fleet.yml" in done.stdout, \
        done.stdout[-3000:]
    assert recap(done.stdout)["x1"]["failed"] == 1


def test_rolling_restart_under_load_with_the_balancer_hooks_loses_no_request(
        xlab: Lab, inv: Path, secret_values: dict[str, str], tmp_path: Path) -> None:
    """The export's --pre-drain / --post-ready hooks drive the lab's balancer, as for `ernie-deploy restart`:
    one host down at a time, every instance restarted, and no request lost (on any instance)."""
    state = xlab.require_state()
    backends = {h.name: [f"{h.address}:8000"] for h in state.hosts}
    rotation = tmp_path / "rotation.json"
    rotation.write_text(json.dumps([b for bs in backends.values() for b in bs]))
    out = export(inv, tmp_path / "hooked", secret_values, "--pre-drain", hook(rotation, "remove"),
                 "--post-ready", hook(rotation, "add"))
    before = invocations(xlab)
    sampler = Sampler(backends)
    load = LoadBalancer(rotation, "ERNIE-4.5-0.3B-PT", workers=3, max_seconds=240,
                        api_key=secret_values["vllm_api_key"])
    sampler.start()
    load.start()
    try:
        done = playbook(out, "rolling-restart.yml")
    finally:
        outcomes = load.finish()
        sampler.finish()
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr
    after = invocations(xlab)
    assert all(after[h] != before[h] for h in HOSTS)
    assert sampler.most_hosts_down() == 1  # serial 1: one host at a time
    assert {b for _, b in load.removals()} == {b for bs in backends.values() for b in bs}
    assert len(outcomes) > 20
    lost = [o for o in outcomes if not o.ok]
    assert lost == [], lost[:5]


def test_the_exported_balancer_role_and_cycle_drive_haproxy_through_a_rolling_restart_without_a_lost_request(
        lab: Lab, xlab: Lab, inv: Path, secret_values: dict[str, str], tmp_path: Path) -> None:
    """The export with a `vllm_balancers` group (the session lab's lb-1 in front of x1-x3; lab hosts share this
    machine's network): site.yml installs, enables and starts HAProxy with every instance UP and leaves the
    instances alone; rolling-restart.yml then drains each server on HAProxy's admin socket before its instance
    stops and sets it ready once it verified, under a load sent only to lb-1's frontend, and no request fails.
    HAProxy's own socket and journal are the judges, not the play's output."""
    session = lab.require_state()
    (spec,) = [BalancerSpec(b.name, b.address) for b in session.balancers if b.name == BALANCER]
    data = yaml.safe_load(inv.read_text())
    data["all"]["children"][BALANCER_GROUP] = balancer_group([spec], Path(session.key), Path(session.known_hosts))
    balanced = tmp_path / "balanced.yml"
    balanced.write_text(yaml.safe_dump(data, sort_keys=False))
    servers = {f"{host}-{unit.removeprefix('/etc/systemd/system/ernie-vllm-').removesuffix('.service')}"
               for host, units in rendered(balanced, tmp_path / "render").items() for unit in units}
    saved = lab.ssh(BALANCER, f"test -e {SAVED} || cp /etc/haproxy/haproxy.cfg {SAVED}")
    assert saved.returncode == 0, saved.stderr
    lab.ssh(BALANCER, RESET)
    lb = LabBalancer(lab, BALANCER)
    try:
        out = export(balanced, tmp_path / "balanced", secret_values)
        running = invocations(xlab)
        done = playbook(out, "site.yml")
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr
        stats = recap(done.stdout)
        assert stats[BALANCER]["changed"] > 0 and stats[BALANCER]["failed"] == 0, done.stdout[-3000:]
        assert {h: stats[h]["changed"] for h in HOSTS} == dict.fromkeys(HOSTS, 0), done.stdout[-3000:]
        assert invocations(xlab) == running  # adding a balancer restarts no instance
        assert (lb.unit("is-enabled"), lb.unit("is-active")) == ("enabled", "active")
        assert wait_for(lb.all_up, UP_WITHIN), lb.stats()
        assert set(lb.stats()) == servers, lb.stats()

        load = through(lb.frontend, "ERNIE-4.5-0.3B-PT", tmp_path, workers=6, stream_tokens=300,
                       api_key=secret_values["vllm_api_key"])
        sampler = StateSampler(lb)
        since = time.time()
        load.start()
        sampler.start()
        try:
            time.sleep(1.0)
            started = time.monotonic()
            done = playbook(out, "rolling-restart.yml")
            took = time.monotonic() - started
            time.sleep(1.0)
        finally:
            outcomes = load.finish()
            sampler.finish()
        lost = [o for o in outcomes if not o.ok]
        print(f"\nrolling-restart.yml through {BALANCER}: {took:.1f} s, {len(outcomes)} requests "
              f"({sum(o.stream for o in outcomes)} streamed), {len(lost)} failed")  # the numbers, for a run with -s
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr
        after = invocations(xlab)
        assert all(after[h] != running[h] for h in HOSTS)
        events = lb.events(since)
        for server in servers:
            assert drained_then_ready(events.get(server, [])), (server, events.get(server))
            assert sampler.seen(server, "DRAIN"), server
        assert sampler.most_out_at_once() == 1  # serial 1, one instance at a time
        assert len(outcomes) > 20 and lost == [], (len(outcomes), lost[:5])
        assert wait_for(lb.all_up, UP_WITHIN), lb.stats()
    finally:
        lab.ssh(BALANCER, RESET)


def test_a_startup_fault_stops_the_play_after_its_batch_with_that_host_restored(
        capsys: pytest.CaptureFixture[str], xlab: Lab, inv: Path, secret_values: dict[str, str],
        tmp_path: Path) -> None:
    old = rendered(inv, tmp_path / "before")
    changed = write_inventory(xlab.require_state(), tmp_path / "changed.yml", secret_values,
                              x2={"vllm_max_model_len": 1536})
    xlab.ssh("x2", f"cat > {FAULTS}", input=json.dumps({**QUICK, "when": {"max_model_len": 1536},
                                                         "fail_startup": "cuda_oom"}))
    before = invocations(xlab)
    try:
        out = export(changed, tmp_path / "changed", secret_values)
        done = playbook(out, "rolling-restart.yml")
    finally:
        xlab.ssh("x2", f"cat > {FAULTS}", input=json.dumps(QUICK))
    assert done.returncode != 0
    stats = recap(done.stdout)
    assert stats["x1"]["failed"] == 0 and stats["x2"]["failed"] == 1 and "x3" not in stats, done.stdout[-4000:]
    # The fatal start-up line ended the wait at once (the budget is vllm_startup_budget, 600 s): the wait names
    # the signature, which only the journal scan does (a timeout says "not ready after").
    assert "failed to start: cuda_out_of_memory" in done.stdout and "restored release" in done.stdout, \
        done.stdout[-4000:]
    after = invocations(xlab)
    assert after["x1"] != before["x1"] and after["x3"] == before["x3"]
    # x2 runs what it ran before (the old units, verified by ernie-deploy against the original inventory).
    assert on_host(xlab, "x2", sorted(old["x2"])) == old["x2"]
    rc, doc = cli(capsys, "verify", "-i", str(inv), "--limit", "x2")
    assert rc == 0, doc
