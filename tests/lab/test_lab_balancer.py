"""The lab's balancer host (lb-1, Debian's HAProxy) in front of every instance, configured by `deploy` and driven by
rolling restarts (issue 24). A bounded load goes through lb-1's frontend only, and HAProxy's own view (its admin
socket, its journal) is read independently of ernie-deploy's report.

Every host drains with vllm_drain_timeout 0 (vLLM's own default: it aborts whatever is in flight when it stops),
so a request is lost whenever an instance stops with work on it: only the balancer's drain stands between the
load and a loss, which the `--no-balancer` scenario shows. The module deploys once; each scenario leaves every
host on its base release and every server UP, and the module cleans the hosts and the balancer afterwards.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from lab.haproxy import LabBalancer, StateSampler, drained_then_ready
from lab.labhelpers import clean, inventory, wait_for
from lab.loadgen import LoadBalancer, Outcome, complete, through
from lab.test_lab_deploy import start_times
from lab.test_lab_rollout import QUICK, faults, run

pytestmark = pytest.mark.lab

MODEL = "ERNIE-4.5-0.3B-PT"
BALANCER = "lb-1"
BASE = {"vllm_drain_timeout": 0}
ROOT = Path(__file__).resolve().parent.parent.parent
# lb-1 as the image left it (HAProxy installed, disabled, Debian's sample configuration): what the module puts back.
SAVED = "/root/haproxy.cfg.debian"
RESET = ("systemctl disable --now -q haproxy.service; systemctl reset-failed haproxy.service; "
         f"cp {SAVED} /etc/haproxy/haproxy.cfg; rm -f /etc/haproxy/haproxy.cfg.ernie-*; "
         "rm -rf /etc/ernie-deploy /var/lib/ernie-deploy /var/log/ernie-deploy")
# HAProxy sees a restarted instance UP two checks (rise 2, every second) after it serves.
UP_WITHIN = 15


@dataclass(frozen=True)
class Fleet:
    inventory: Path  # every host on its base plan, lb-1 in vllm_balancers
    balancer: LabBalancer
    servers: frozenset[str]  # the server names HAProxy must have: one per instance


def messages(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(h["host"], h["status"], h["message"]) for h in doc["hosts"]]


@pytest.fixture(scope="module")
def fleet(lab: Lab, lab_state: LabState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The whole lab deployed, lb-1 included; every host and lb-1 cleaned before and after."""
    clean(lab, lab_state)
    saved = lab.ssh(BALANCER, f"test -e {SAVED} || cp /etc/haproxy/haproxy.cfg {SAVED}")
    assert saved.returncode == 0, saved.stderr
    lab.ssh(BALANCER, RESET)
    for h in lab_state.hosts:
        faults(lab, h.name, QUICK)
    os.environ["ERNIE_DEPLOY_STATE_DIR"] = str(tmp_path_factory.mktemp("balanced-rollouts"))
    inv = inventory(lab_state, tmp_path_factory.mktemp("balanced"), balancers=True,
                    host_vars={h.name: BASE for h in lab_state.hosts})
    try:
        started = time.monotonic()
        rc = main(["deploy", "-i", str(inv), "--startup-budget", "60"])
        print(f"\ndeploy of {len(lab_state.hosts)} hosts and {BALANCER}: {time.monotonic() - started:.1f} s")
        assert rc == 0
        yield Fleet(inv, LabBalancer(lab, BALANCER), frozenset(f"{h.name}-0" for h in lab_state.hosts))
    finally:
        os.environ.pop("ERNIE_DEPLOY_STATE_DIR", None)
        for h in lab_state.hosts:
            lab.ssh(h.name, "rm -f /etc/ernie-lab/faults.json")
        clean(lab, lab_state)
        lab.ssh(BALANCER, RESET)


def load(fleet: Fleet, tmp_path: Path) -> LoadBalancer:
    """Every request through lb-1's frontend. Streams of 300 tokens (1.5-3 s on the simulator) keep several
    requests on every instance at any time, so an instance stopped with work on it loses some."""
    return through(fleet.balancer.frontend, MODEL, tmp_path, workers=8, stream_tokens=300)


@dataclass
class Watched:
    rc: int
    doc: dict[str, Any]
    outcomes: list[Outcome]
    samples: StateSampler
    events: dict[str, list[str]]  # HAProxy's journal, per server, since the command started

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


def under_load(capsys: pytest.CaptureFixture[str], fleet: Fleet, tmp_path: Path, *argv: str) -> Watched:
    """Run a rollout command while the load runs through the balancer and its servers' states are sampled."""
    lb, sampler = load(fleet, tmp_path), StateSampler(fleet.balancer)
    since = time.time()
    lb.start()
    sampler.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        rc, doc = run(capsys, *argv)
        took = time.monotonic() - started
        time.sleep(1.0)
    finally:
        outcomes = lb.finish()
        sampler.finish()
    watched = Watched(rc, doc, outcomes, sampler, fleet.balancer.events(since))
    with capsys.disabled():  # the numbers, for a run with -s
        why = Counter(o.detail[:80] for o in watched.lost).most_common(2)
        print(f"\n{' '.join(argv[:1] + argv[3:])}: {took:.1f} s, {len(outcomes)} requests "
              f"({sum(o.stream for o in outcomes)} streamed), {len(watched.lost)} failed{f' {why}' if why else ''}, "
              f"at most {sampler.most_out_at_once()} server(s) out of rotation at once")
    return watched


def test_deploy_starts_haproxy_with_every_instance_up_and_an_unchanged_deploy_does_not_reload_it(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Fleet) -> None:
    lb = fleet.balancer
    assert (lb.unit("is-enabled"), lb.unit("is-active")) == ("enabled", "active")
    assert wait_for(lb.all_up, UP_WITHIN), lb.stats()
    stats = lb.stats()
    assert set(stats) == fleet.servers, stats
    # The GPU hosts' images have HAProxy too (one root file system), but nothing enabled it there.
    assert {lab.ssh(h.name, "systemctl is-enabled haproxy.service").stdout.strip() for h in lab_state.hosts} \
        == {"disabled"}
    # Its frontend serves the fleet's model.
    ok, detail = complete(lb.frontend, MODEL, stream=False, max_tokens=8)
    assert ok, detail

    worker = lb.worker_pid()
    rc, doc = run(capsys, "deploy", "-i", str(fleet.inventory))
    assert rc == 0, messages(doc)
    assert doc["by_host"][BALANCER]["status"] == "ok", doc["by_host"][BALANCER]
    assert lb.worker_pid() == worker  # unchanged configuration: no reload


def test_serial_restart_through_haproxy_loses_nothing_and_takes_one_server_out_at_a_time(
        capsys: pytest.CaptureFixture[str], lab_state: LabState, fleet: Fleet, tmp_path: Path) -> None:
    """`restart --serial 1` under load: each server drained on HAProxy, its instance restarted, set ready, and UP
    again before the next one goes: HAProxy never has two out, and no client request fails."""
    seen = under_load(capsys, fleet, tmp_path, "restart", "-i", str(fleet.inventory), "--serial", "1")
    assert seen.rc == 0, messages(seen.doc)
    assert seen.doc["rollout"]["batches"] == [[h.name] for h in lab_state.hosts]
    assert seen.doc["rollout"]["balancers"]["driven"]
    assert len(seen.outcomes) > 50 and not seen.lost, seen.lost[:5]
    for server in fleet.servers:
        assert drained_then_ready(seen.events.get(server, [])), (server, seen.events.get(server))
        assert seen.samples.seen(server, "DRAIN"), server
    assert seen.samples.most_out_at_once() == 1
    assert wait_for(fleet.balancer.all_up, UP_WITHIN), fleet.balancer.stats()


def test_half_the_fleet_at_a_time_loses_nothing(capsys: pytest.CaptureFixture[str], lab_state: LabState,
                                                fleet: Fleet, tmp_path: Path) -> None:
    """`--serial 50%`: two hosts at a time; never more than a batch out of rotation, every server drained and back
    UP, no client request fails."""
    seen = under_load(capsys, fleet, tmp_path, "restart", "-i", str(fleet.inventory), "--serial", "50%")
    assert seen.rc == 0, messages(seen.doc)
    names = [h.name for h in lab_state.hosts]
    assert seen.doc["rollout"]["batches"] == [names[:2], names[2:]]
    assert len(seen.outcomes) > 30 and not seen.lost, seen.lost[:5]
    for server in fleet.servers:
        assert drained_then_ready(seen.events.get(server, [])), (server, seen.events.get(server))
    assert 1 <= seen.samples.most_out_at_once() <= 2
    assert wait_for(fleet.balancer.all_up, UP_WITHIN), fleet.balancer.stats()


def test_rollback_after_a_start_up_failure_loses_nothing_and_ends_with_every_server_up(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Fleet, tmp_path: Path) -> None:
    """A rolling deploy, a10-1 as its canary, whose new release fails on a10-2 (vLLM's CUDA OOM, only with the
    changed flag): a10-2 is rolled back and the rollout stops after it. The balancer drained exactly the instances
    that stopped, set each ready again, and no client request failed."""
    faults(lab, "a10-2", {**QUICK, "when": {"max_model_len": 1344}, "fail_startup": "cuda_oom"})
    changed = inventory(lab_state, tmp_path, "changed.yml", balancers=True,
                        host_vars={h.name: {**BASE, "vllm_max_model_len": 1344} for h in lab_state.hosts})
    try:
        seen = under_load(capsys, fleet, tmp_path, "deploy", "-i", str(changed), "--canary", "1", "--serial", "1")
    finally:
        faults(lab, "a10-2", QUICK)
    hosts = seen.doc["by_host"]
    assert seen.rc == 2 and hosts["a10-1"]["status"] == "changed" and hosts["a10-2"]["status"] == "failed", \
        messages(seen.doc)
    assert any("rolled back to release" in x for x in hosts["a10-2"]["rollbacks"]), hosts["a10-2"]["rollbacks"]
    assert seen.doc["rollout"]["batches"][:2] == [["a10-1"], ["a10-2"]]
    assert "stopped after batch 2" in seen.doc["rollout"]["stopped"]
    assert seen.doc["rollout"]["out_of_rotation"] == {}
    assert len(seen.outcomes) > 30 and not seen.lost, seen.lost[:5]
    for server in ("a10-1-0", "a10-2-0"):
        assert drained_then_ready(seen.events.get(server, [])), (server, seen.events.get(server))
    for server in ("a10-4-0", "a100-2-0"):  # the rollout stopped before them
        assert not [e for e in seen.events.get(server, []) if "drain" in e], seen.events[server]
    assert wait_for(fleet.balancer.all_up, UP_WITHIN), fleet.balancer.stats()

    rc, doc = run(capsys, "deploy", "-i", str(fleet.inventory), "--limit", "a10-1")  # a10-1 back on its base
    assert rc == 0, messages(doc)
    assert wait_for(fleet.balancer.all_up, UP_WITHIN), fleet.balancer.stats()


def test_the_same_load_without_the_balancer_loses_requests(capsys: pytest.CaptureFixture[str], fleet: Fleet,
                                                           tmp_path: Path) -> None:
    """`--no-balancer`: HAProxy keeps sending work to each instance until its checks fail, and vLLM aborts what it
    holds when it stops (the idle wait gives up after 1 s under a steady load). Requests are lost: the load above
    can tell."""
    seen = under_load(capsys, fleet, tmp_path, "restart", "-i", str(fleet.inventory), "--serial", "50%",
                      "--no-balancer", "--idle-timeout", "1")
    assert seen.rc == 0, messages(seen.doc)
    assert not seen.doc["rollout"]["balancers"]["driven"]
    assert seen.lost, f"{len(seen.outcomes)} requests and none lost"
    assert not [e for events in seen.events.values() for e in events if "drain" in e], seen.events
    assert wait_for(fleet.balancer.all_up, UP_WITHIN), fleet.balancer.stats()


def test_unreachable_balancer_refuses_the_rollout_before_anything_restarts(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Fleet, tmp_path: Path) -> None:
    data = yaml.safe_load(fleet.inventory.read_text())
    data["all"]["children"]["vllm_balancers"]["hosts"][BALANCER]["ansible_port"] = 1  # nothing listens there
    closed = tmp_path / "closed.yml"
    closed.write_text(yaml.safe_dump(data))
    before = {h.name: start_times(lab, h.name) for h in lab_state.hosts}
    rc, doc = run(capsys, "restart", "-i", str(closed))
    assert rc == 2, messages(doc)
    refused = doc["rollout"]["balancers"]["refused"]
    assert refused and all(r.startswith(f"{BALANCER}: unreachable") for r in refused), refused
    assert all(h["status"] == "failed" and BALANCER in h["message"] and "--no-balancer" in h["hint"]
               for h in doc["hosts"]), messages(doc)
    assert {h.name: start_times(lab, h.name) for h in lab_state.hosts} == before
    assert fleet.balancer.all_up(), fleet.balancer.stats()


def test_template_failing_haproxy_check_changes_nothing(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                        lab_state: LabState, fleet: Fleet, tmp_path: Path) -> None:
    """A vllm_balancer_template HAProxy rejects: deploy fails quoting HAProxy, lb-1 keeps its configuration and
    its running process (same worker, same servers UP), and no instance was touched although a10-1 had a change
    to deploy."""
    template = tmp_path / "haproxy.cfg.j2"
    template.write_text((ROOT / "templates/haproxy.cfg.j2").read_text()
                        .replace("global\n", "global\n    no-such-directive on\n", 1))
    bad = inventory(lab_state, tmp_path, "bad.yml", balancers=True,
                    host_vars={**{h.name: BASE for h in lab_state.hosts}, "a10-1": {**BASE, "vllm_max_model_len": 1280},
                               BALANCER: {"vllm_balancer_template": str(template)}})
    config = "sha256sum /etc/haproxy/haproxy.cfg"
    before = (lab.ssh(BALANCER, config).stdout, fleet.balancer.worker_pid(), fleet.balancer.stats(),
              {h.name: start_times(lab, h.name) for h in lab_state.hosts})
    rc, doc = run(capsys, "deploy", "-i", str(bad))
    result = doc["by_host"][BALANCER]
    assert rc != 0 and result["status"] == "failed", messages(doc)
    assert "haproxy -c" in result["message"], result["message"]
    assert any("unknown keyword 'no-such-directive'" in line for line in result["evidence"]), result["evidence"]
    assert all(doc["by_host"][h.name]["status"] == "skipped" for h in lab_state.hosts), messages(doc)
    after_stats = fleet.balancer.stats()
    assert (lab.ssh(BALANCER, config).stdout, fleet.balancer.worker_pid(),
            {s: v.status for s, v in after_stats.items()},
            {h.name: start_times(lab, h.name) for h in lab_state.hosts}) == \
        (before[0], before[1], {s: v.status for s, v in before[2].items()}, before[3])


# The EngineCore of a host's instance: real vLLM rewrites its command line, the simulator names the process (comm
# is 15 bytes at most).
KILL_ENGINE = ("pid=$(pgrep -o -f '^VLLM::EngineCore' || pgrep -o -x 'VLLM::EngineCor') && kill -9 \"$pid\" "
               "&& echo \"$pid\"")
# systemd restarts it after RestartSec=10; the simulator serves ~3 s later; HAProxy takes two checks to call it UP.
BACK_WITHIN = 40


def test_an_engine_killed_under_load_comes_back_by_itself_and_status_tells_the_story(
        capsys: pytest.CaptureFixture[str], lab: Lab, lab_state: LabState, fleet: Fleet, tmp_path: Path) -> None:
    """kill -9 of one instance's EngineCore while the load runs through lb-1: vLLM exits 0 on an engine death, so
    only the unit's Restart=always brings it back; no operator acts. The requests it held are lost (they were on
    the engine that died); HAProxy's checks take it out, then back once it serves again, and `status` names the
    death by vLLM's own line, the restart and how long it took to serve again."""
    victim = lab_state.hosts[0].name
    lb, sampler = load(fleet, tmp_path), StateSampler(fleet.balancer)
    before = start_times(lab, victim)
    lb.start()
    sampler.start()
    try:
        time.sleep(1.0)
        killed = lab.ssh(victim, KILL_ENGINE)
        assert killed.returncode == 0, killed.stderr
        assert wait_for(lambda: start_times(lab, victim) != before, BACK_WITHIN), "systemd did not restart it"
        assert wait_for(fleet.balancer.all_up, BACK_WITHIN), fleet.balancer.stats()
        time.sleep(1.0)
    finally:
        outcomes = lb.finish()
        sampler.finish()
    lost = [o for o in outcomes if not o.ok]
    # What the dead engine held and what HAProxy sent it before its checks failed; the other servers carry the rest.
    assert len(outcomes) > len(lost) * 4, (len(outcomes), Counter(o.detail[:80] for o in lost))
    journal = lab.ssh(victim, "journalctl -u ernie-vllm-0.service -o cat --no-pager -n 400").stdout
    assert "Deactivated successfully" in journal, journal[-2000:]  # exit 0, as real vLLM: only Restart=always helps
    assert "Scheduled restart job, restart counter is at 1." in journal
    capsys.readouterr()
    main(["status", "-i", str(fleet.inventory), "--limit", victim, "--json"])
    doc = json.loads(capsys.readouterr().out)
    inst = doc["hosts"][victim]["instances"][0]
    assert inst["restarts"] == 1 and inst["death"] is not None, json.dumps(doc, indent=1)
    story = inst["death"]["text"]
    assert story.startswith("engine died at ") and "restarted by systemd, serving again after" in story, story
    assert "engine core exited unexpectedly" in story or "died unexpectedly" in story, story
    assert inst["death"]["serving"]
