"""Deploy over SSH against the lab's real sshd and systemd (issue: deploy, facts, converge, locks)."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from ernie_deploy.planning.render import environment_for_templates, render_host, templates_dir
from ernie_deploy.remote import converge
from ernie_deploy.remote.ssh import Target, connect
from lab.labhelpers import CLEAN, cleaned, wait_for

pytestmark = pytest.mark.lab

UNITS_GLOB = "/etc/systemd/system/ernie-vllm-*.service /etc/ernie-deploy/ernie-vllm-*.env"


@pytest.fixture(scope="module")
def deployed(lab: Lab, lab_state: LabState) -> Iterator[LabState]:
    with cleaned(lab, lab_state):
        yield lab_state


def write_inventory(state: LabState, tmp: Path, **host_vars: dict[str, Any]) -> Path:
    data = yaml.safe_load(Path(state.inventory).read_text())
    for name, extra in host_vars.items():
        data["all"]["children"]["lab"]["hosts"].setdefault(name, {}).update(extra)
    path = tmp / "inventory.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def deploy(capsys: pytest.CaptureFixture[str], inv: Path, *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main(["deploy", "-i", str(inv), "--json", "--startup-budget", "60", *args])
    out = capsys.readouterr().out
    return rc, {h["host"]: h for h in json.loads(out)["hosts"]}


def snapshot(lab: Lab, state: LabState) -> dict[str, str]:
    """File hashes and unit start times on every host: what --check must leave identical."""
    script = (f"sha256sum {UNITS_GLOB} 2>/dev/null; for u in $(ls /etc/systemd/system | grep ernie-vllm); do "
              "systemctl show -p Id,ActiveState,ExecMainStartTimestampMonotonic $u; done; ls -a /var/lib/ernie-deploy "
              "2>/dev/null")
    return {h.name: lab.ssh(h.name, script).stdout for h in state.hosts}


def start_times(lab: Lab, host: str) -> dict[str, str]:
    out = lab.ssh(host, "for u in $(ls /etc/systemd/system | grep ernie-vllm); do "
                        "echo $u $(systemctl show -p ExecMainStartTimestampMonotonic --value $u); done").stdout
    return dict(line.split() for line in out.splitlines())


def test_check_on_fresh_hosts_changes_nothing(capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState,
                                               tmp_path: Path) -> None:
    before = snapshot(lab, deployed)
    rc, hosts = deploy(capsys, write_inventory(deployed, tmp_path), "--check", "--diff")
    assert rc == 0
    assert all(h["status"] == "changed" for h in hosts.values())
    assert any("+ExecStart=/opt/vllm/0.34.0/bin/vllm serve /models/ERNIE-4.5-0.3B-PT" in d
               for d in hosts["a10-2"]["diffs"])
    assert snapshot(lab, deployed) == before


def test_deploy_makes_every_unit_active_healthy_and_exactly_rendered(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    inv = write_inventory(deployed, tmp_path)
    rc, hosts = deploy(capsys, inv)
    assert rc == 0, hosts
    assert {h["status"] for h in hosts.values()} == {"changed"}
    from ernie_deploy.inventory.inventory import load_inventory
    from ernie_deploy.orchestration.snapshot import discovered
    from ernie_deploy.planning.plan import PlanContext, build_plan, read_inputs
    from ernie_deploy.remote.facts import gather_command, parse_facts

    env = environment_for_templates(templates_dir())
    for host in load_inventory(inv).select(None):
        session = connect(Target.from_host(host.name, host.address, host.port, host.user, host.vars))
        with session:
            gather = gather_command("/models/ERNIE-4.5-0.3B-PT", "/opt/vllm/0.34.0/bin/vllm")
            facts = parse_facts(session.run(gather).text)
        ctx = PlanContext.load()
        plan = build_plan(read_inputs(host, ctx), ctx, discovered(facts))
        (unit, _env) = render_host(plan, env)
        shown = lab.ssh(host.name, "systemctl cat ernie-vllm-0.service").stdout
        # systemctl cat prefixes the file's path as a comment line; the rest is the file, byte for byte.
        assert shown.split("\n", 1)[1] == unit.content
        assert lab.ssh(host.name, "systemctl is-active ernie-vllm-0.service").stdout.strip() == "active"
        address = host.vars["ansible_host"]
        status = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                 f"http://{address}:8000/health"], capture_output=True, text=True, timeout=30)
        assert status.stdout == "200", host.name
        mode = lab.ssh(host.name, "stat -c '%a %U' /etc/ernie-deploy/ernie-vllm-0.env").stdout.strip()
        assert mode == "600 root"
    audit = lab.ssh("a10-2", "cat /var/log/ernie-deploy/audit.log").stdout.splitlines()
    entry = json.loads(audit[-1])
    assert entry["host"] == "a10-2" and {f["path"] for f in entry["files"]} == {
        "/etc/systemd/system/ernie-vllm-0.service", "/etc/ernie-deploy/ernie-vllm-0.env"}


def test_second_deploy_changes_and_restarts_nothing_in_one_command(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    before = {h.name: start_times(lab, h.name) for h in deployed.hosts}
    rc, hosts = deploy(capsys, write_inventory(deployed, tmp_path))
    assert rc == 0
    assert {h["status"] for h in hosts.values()} == {"ok"}
    # One SSH connection and one command per host: the facts, read without the lock (nothing to change).
    assert {h["remote_commands"] for h in hosts.values()} == {1}
    assert {h.name: start_times(lab, h.name) for h in deployed.hosts} == before


def test_changing_one_hosts_variable_restarts_only_its_instance(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    before = {h.name: start_times(lab, h.name) for h in deployed.hosts}
    rc, hosts = deploy(capsys, write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_max_model_len": 2048}}),
                       "--diff")
    assert rc == 0
    assert hosts["a10-2"]["status"] == "changed" and hosts["a10-2"]["restarted"] == ["ernie-vllm-0.service"]
    assert hosts["a10-2"]["changed_files"] == ["/etc/systemd/system/ernie-vllm-0.service"]
    diff = hosts["a10-2"]["diffs"][0]
    assert "---" in diff and "-ExecStart=" in diff and "--max-model-len 2048" in diff
    after = {h.name: start_times(lab, h.name) for h in deployed.hosts}
    assert after["a10-2"] != before["a10-2"]
    assert {k: v for k, v in after.items() if k != "a10-2"} == {k: v for k, v in before.items() if k != "a10-2"}
    assert "Using max model len 2048" in lab.ssh("a10-2", "journalctl -u ernie-vllm-0 --no-pager -o cat").stdout


def test_secret_change_diff_is_redacted_and_env_file_is_0600(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_api_key": "sk-lab-secret-1"}})
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1", "--diff")
    assert rc == 0 and hosts["a10-1"]["restarted"] == ["ernie-vllm-0.service"]
    text = json.dumps(hosts)
    assert "sk-lab-secret-1" not in text and "VLLM_API_KEY=[REDACTED]" in text
    assert "sk-lab-secret-1" not in lab.ssh("a10-1", "ps -eo args").stdout  # never on a command line
    assert lab.ssh("a10-1", "systemctl cat ernie-vllm-0.service | grep -c sk-lab").stdout.strip() == "0"


def test_env_values_and_names_reach_the_process_byte_for_byte(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    """Issue 23: `$` arrived doubled and `%h` was expanded; the process's own environment is the judge."""
    env = {"SINGLE": "it's", "DOUBLE": 'say "hi"', "DOLLAR": "$HOME ${HOME} $$", "SUBST": "$(id)`id`",
           "PERCENT": "100%h %% %i", "BACKSLASH": "a\\b\\\\c\\n\\$x", "SPACES": "  two  spaces  ",
           "HASH": "#not a comment", "MIXED": "'\"$%\\ #;"}
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_env": env, "vllm_served_model_name": "lab%h"}})
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1")
    assert rc == 0, hosts
    pid = lab.ssh("a10-1", "systemctl show -p MainPID --value ernie-vllm-0.service").stdout.strip()
    raw = base64.b64decode(lab.ssh("a10-1", f"base64 -w0 /proc/{pid}/environ").stdout)
    environ = dict(item.split("=", 1) for item in raw.decode().split("\0") if item)
    assert {k: environ.get(k) for k in env} == env
    shown = lab.ssh("a10-1", "systemctl show -p Description --value ernie-vllm-0.service").stdout
    assert shown.startswith("vLLM serving lab%h on port 8000")


def test_host_with_wrong_gpu_count_fails_with_both_numbers_and_is_untouched(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    before = snapshot(lab, deployed)
    rc, hosts = deploy(capsys, write_inventory(deployed, tmp_path, **{"a10-2": {"gpu_count": 4}}), "--limit", "a10-2")
    assert rc == 2
    assert hosts["a10-2"]["status"] == "failed"
    assert "gpu_count: inventory says 4, nvidia-smi found 2" in hosts["a10-2"]["findings"][0]["message"]
    assert snapshot(lab, deployed)["a10-2"] == before["a10-2"]


def test_changed_host_key_is_refused_with_fingerprint(capsys: pytest.CaptureFixture[str], deployed: LabState,
                                                      tmp_path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()
    lines = Path(deployed.known_hosts).read_text().splitlines()
    address = deployed.host("a10-1").address
    forged = [f"{address} {other[0]} {other[1]}" if line.startswith(address + " ") else line for line in lines]
    (tmp_path / "known_hosts").write_text("\n".join(forged) + "\n")
    inv = write_inventory(deployed, tmp_path)
    data = yaml.safe_load(inv.read_text())
    data["all"]["children"]["lab"]["vars"]["ernie_known_hosts"] = str(tmp_path / "known_hosts")
    inv.write_text(yaml.safe_dump(data))
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1,a10-2")
    assert rc == 2
    assert hosts["a10-1"]["status"] == "failed"
    assert "host key refused" in hosts["a10-1"]["message"] and "CHANGED" in hosts["a10-1"]["message"]
    assert "SHA256:" in hosts["a10-1"]["message"] and "ssh-keygen -R" in hosts["a10-1"]["hint"]
    assert hosts["a10-2"]["status"] in ("ok", "changed")  # reachable and deployed


def test_unknown_host_key_refused_unless_accept_new(capsys: pytest.CaptureFixture[str], deployed: LabState,
                                                    tmp_path: Path) -> None:
    inv = write_inventory(deployed, tmp_path)
    data = yaml.safe_load(inv.read_text())
    data["all"]["children"]["lab"]["vars"]["ernie_known_hosts"] = str(tmp_path / "empty_known_hosts")
    inv.write_text(yaml.safe_dump(data))
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1")
    assert rc == 2 and "unknown host key" in hosts["a10-1"]["message"] and "SHA256:" in hosts["a10-1"]["message"]
    # Check mode changes nothing, the controller's known_hosts included: it only says what it would record.
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1", "--host-key-policy", "accept-new", "--check")
    assert rc == 0 and not (tmp_path / "empty_known_hosts").exists()
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1", "--host-key-policy", "accept-new")
    assert rc == 0
    recorded = (tmp_path / "empty_known_hosts").read_text()
    assert recorded.startswith(deployed.host("a10-1").address + " ssh-ed25519 ")


def test_stopped_host_is_unreachable_while_others_deploy(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                         deployed: LabState, tmp_path: Path) -> None:
    # Stop sshd with a transient timer that brings it back, so the lab host recovers by itself.
    lab.ssh("a10-4", "systemd-run -q --on-active=25 /bin/systemctl start ssh.service; systemctl stop ssh.service")
    try:
        rc, hosts = deploy(capsys, write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_max_model_len": 3072}}))
        assert rc == 4
        assert hosts["a10-4"]["status"] == "unreachable"
        assert hosts["a10-2"]["status"] == "changed" and hosts["a10-1"]["status"] in ("ok", "changed")
    finally:
        # The timer fires 25 s after the stop; on a loaded CI machine sshd has been seen to take longer to answer.
        assert wait_for(lambda: lab.ssh("a10-4", "true", timeout=10).returncode == 0, timeout=150, interval=1)


def test_held_lock_fails_cleanly_then_lock_wait_succeeds(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                         deployed: LabState, tmp_path: Path) -> None:
    info = json.dumps({"token": "otherrun", "user": "alice", "controller": "ops1", "pid": 7, "since": 0,
                       "command": "ernie-deploy deploy"})
    lab.ssh("a10-1", "mkdir -p /var/lib/ernie-deploy/lock && cat > /var/lib/ernie-deploy/lock/info", input=info)
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_max_model_len": 3000}})
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1")
    assert rc == 6 and hosts["a10-1"]["status"] == "locked"
    assert "alice@ops1 (pid 7)" in hosts["a10-1"]["message"]
    capsys.readouterr()
    assert main(["lock", "-i", str(inv), "--limit", "a10-1", "--show"]) == 0
    assert "alice@ops1" in capsys.readouterr().out
    lab.ssh("a10-1", "(sleep 2; rm -rf /var/lib/ernie-deploy/lock) >/dev/null 2>&1 &")  # the other run ends
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1", "--lock-wait", "30")
    assert rc == 0 and hosts["a10-1"]["status"] == "changed"
    assert lab.ssh("a10-1", "test -e /var/lib/ernie-deploy/lock").returncode != 0  # ours was released


def test_truncated_upload_leaves_no_half_written_file(lab: Lab, deployed: LabState) -> None:
    """A controller killed mid-upload: the stream ends early, tar fails, nothing is moved, no temp is left."""
    from ernie_deploy.inventory.inventory import load_inventory
    from ernie_deploy.planning.plan import PlanContext, plan_host

    host = load_inventory(Path(deployed.inventory)).hosts["a10-1"]
    plan = plan_host(host, PlanContext.load())
    files = render_host(plan, environment_for_templates(templates_dir()))
    files = [type(f)(f.path, f.content + "# padding\n" * 2000, f.mode, f.secret) for f in files]
    before = lab.ssh("a10-1", f"sha256sum {UNITS_GLOB}").stdout
    from ernie_deploy.remote.facts import HostFacts

    changes = converge.compute_changes(plan, files, HostFacts(), prune=False)
    stage = converge.stage_command(files, changes, {"test": "truncated"}, {"id": "20260101T000000Z-truncate"}, 5)
    half = replace(stage, stdin=stage.stdin[: len(stage.stdin) // 2], check=False)
    with connect(Target.from_host(host.name, host.address, host.port, host.user, host.vars)) as session:
        result = session.run(half)
    assert result.code != 0
    assert lab.ssh("a10-1", f"sha256sum {UNITS_GLOB}").stdout == before
    leftovers = lab.ssh("a10-1", "ls -a /etc/systemd/system /etc/ernie-deploy /var/lib/ernie-deploy").stdout
    assert ".new" not in leftovers and "staging" not in leftovers


def test_killed_deploy_process_leaves_whole_files(lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_max_model_len": 1024}})
    proc = subprocess.Popen([sys.executable, "-m", "ernie_deploy", "deploy", "-i", str(inv), "--limit", "a10-1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.8)  # somewhere in connect / gather / apply
    proc.kill()
    proc.wait(timeout=10)
    unit = lab.ssh("a10-1", "cat /etc/systemd/system/ernie-vllm-0.service").stdout
    assert unit.endswith("WantedBy=multi-user.target\n")  # whole: old or new, never cut
    assert ".new" not in lab.ssh("a10-1", "ls -a /etc/systemd/system /etc/ernie-deploy").stdout
    lab.ssh("a10-1", "rm -rf /var/lib/ernie-deploy/lock")  # the killed run could not release its lock


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_concurrent_deploy_is_refused_and_ctrl_c_releases_the_lock(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                                   deployed: LabState, tmp_path: Path,
                                                                   sig: int, code: int) -> None:
    """While one deploy waits for its restarted instance to load, a second one fails cleanly naming the
    holder. SIGINT (or SIGTERM) then stops the first at once (not at the start-up budget): exit 130 (143),
    no lock left, the host's result printed. A deploy over the instance that is still loading then judges
    only the new process: the old one's shutdown traceback is not its failure."""
    lab.ssh("a10-1", "mkdir -p /etc/ernie-lab && cat > /etc/ernie-lab/faults.json",
            input=json.dumps({"load_seconds": 120}))
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_max_model_len": 1280, "vllm_stable_seconds": 2}})
    proc = subprocess.Popen([sys.executable, "-m", "ernie_deploy", "deploy", "-i", str(inv), "--limit", "a10-1",
                             "--startup-budget", "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        restarted = wait_for(lambda: lab.ssh(
            "a10-1", "test -d /var/lib/ernie-deploy/lock && systemctl cat ernie-vllm-0.service | "
                     "grep -q -- '--max-model-len 1280' && systemctl is-active ernie-vllm-0.service").returncode == 0,
            timeout=60, interval=0.3)
        assert restarted and proc.poll() is None, "the deploy should be waiting for the loading instance"
        rc, hosts = deploy(capsys, inv, "--limit", "a10-1")
        assert rc == 6 and hosts["a10-1"]["status"] == "locked"
        assert f"(pid {proc.pid})" in hosts["a10-1"]["message"]
        assert proc.poll() is None, "the first deploy should still be waiting for the loading instance"
        interrupted = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code and "interrupted" in err
        assert "a10-1" in out and "PLAY RECAP" in out  # every host's result, not a bare traceback
        assert time.monotonic() - interrupted < 10
        assert lab.ssh("a10-1", "test -e /var/lib/ernie-deploy/lock").returncode != 0
        if sig == signal.SIGTERM:
            # Re-deploy a change over the instance that is still loading (load times short again).
            lab.ssh("a10-1", "rm -f /etc/ernie-lab/faults.json")
            again = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_max_model_len": 1408,
                                                                     "vllm_stable_seconds": 2}})
            rc, hosts = deploy(capsys, again, "--limit", "a10-1")
            assert rc == 0 and hosts["a10-1"]["restarted"] == ["ernie-vllm-0.service"], hosts
            assert hosts["a10-1"]["message"] == "changed; every (re)started instance verified"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        lab.ssh("a10-1", "rm -f /etc/ernie-lab/faults.json; " + CLEAN)


def facts_json(capsys: pytest.CaptureFixture[str], inv: Path, host: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main(["facts", "-i", str(inv), "--limit", host, "--json"])
    return rc, json.loads(capsys.readouterr().out)["hosts"][host]


def test_host_behind_a_jump_host_is_reached_through_it(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                       deployed: LabState, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """a10-2 goes by a name only a10-1 can resolve, so its facts can only arrive through a10-1, and the jump
    host's key is checked as strictly as the target's."""
    monkeypatch.setenv("HOME", str(tmp_path))  # only the keys written below count, not this machine's ~/.ssh
    jump, target, hidden = deployed.host("a10-1"), deployed.host("a10-2"), "a10-2.behind-jump"
    lines = Path(deployed.known_hosts).read_text().splitlines()
    target_keys = [f"{hidden} {line.split(' ', 1)[1]}" for line in lines if line.startswith(target.address + " ")]
    jump_keys = [line for line in lines if line.startswith(jump.address + " ")]
    assert target_keys and jump_keys
    lab.ssh("a10-1", f"echo '{target.address} {hidden}' >> /etc/hosts")
    try:
        known = tmp_path / "known_hosts"
        known.write_text("\n".join(target_keys + jump_keys) + "\n")
        behind = {"ansible_host": hidden, "ernie_known_hosts": str(known)}
        via_jump = {**behind, "ansible_ssh_common_args": f"-o ProxyJump=root@{jump.address}"}
        rc, host = facts_json(capsys, write_inventory(deployed, tmp_path, **{"a10-2": via_jump}), "a10-2")
        assert rc == 0 and host["error"] is None, host
        assert [g["name"] for g in host["facts"]["gpus"]] == ["NVIDIA A10", "NVIDIA A10"]

        # Deploy and verify through the jump host: the restart's readiness watch and every HTTP probe
        # (/health, /v1/models, the completion) travel through the SSH session, never from the controller.
        changed = write_inventory(deployed, tmp_path, **{"a10-2": {**via_jump, "vllm_max_model_len": 1280}})
        rc, hosts = deploy(capsys, changed, "--limit", "a10-2")
        assert rc == 0 and hosts["a10-2"]["status"] == "changed", hosts
        assert "ready ernie-vllm-0" in [s["name"] for s in hosts["a10-2"]["steps"]]
        capsys.readouterr()
        rc = main(["verify", "-i", str(changed), "--limit", "a10-2", "--json"])
        (verified,) = json.loads(capsys.readouterr().out)["hosts"]
        checks = {c["name"]: c for c in verified["checks"]}
        assert rc == 0, verified
        assert checks["http_health"]["status"] == "pass"
        # Three round trips: the facts, the probe, and the progress reading of /metrics (docs/progress.md).
        assert checks["http_models"]["status"] == "pass" and verified["remote_commands"] == 3

        command = (f"ssh -i {deployed.key} -o BatchMode=yes -o StrictHostKeyChecking=yes "
                   f"-o UserKnownHostsFile={known} -W %h:%p root@{jump.address}")
        via_command = {**behind, "ansible_ssh_common_args": f"-o 'ProxyCommand={command}'"}
        rc, host = facts_json(capsys, write_inventory(deployed, tmp_path, **{"a10-2": via_command}), "a10-2")
        assert rc == 0 and len(host["facts"]["gpus"]) == 2, host

        rc, host = facts_json(capsys, write_inventory(deployed, tmp_path, **{"a10-2": behind}), "a10-2")
        assert rc == 4 and "unreachable" in host["error"]  # the controller itself cannot resolve the name

        known.write_text("\n".join(target_keys) + "\n")
        rc, host = facts_json(capsys, write_inventory(deployed, tmp_path, **{"a10-2": via_jump}), "a10-2")
        assert rc == 4 and f"jump host {jump.address}:22" in host["error"]
        assert "unknown host key" in host["error"] and "SHA256:" in host["error"]
    finally:
        lab.ssh("a10-1", f"sed -i '/{hidden}/d' /etc/hosts")


def test_sudo_user_can_deploy(capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState,
                              tmp_path: Path) -> None:
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"ansible_user": "deploy", "vllm_max_model_len": 1536}})
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1")
    assert rc == 0, hosts
    assert hosts["a10-1"]["status"] == "changed"
    assert lab.ssh("a10-1", "stat -c '%a %U' /etc/ernie-deploy/ernie-vllm-0.env").stdout.strip() == "600 root"
    assert "--max-model-len 1536" in lab.ssh("a10-1", "systemctl cat ernie-vllm-0.service").stdout


def test_prune_removes_instances_no_longer_planned(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                   deployed: LabState, tmp_path: Path) -> None:
    two = write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}})
    rc, hosts = deploy(capsys, two, "--limit", "a10-2")
    assert rc == 0 and hosts["a10-2"]["restarted"] == ["ernie-vllm-0.service"]
    assert hosts["a10-2"]["started"] == ["ernie-vllm-1.service"]
    one = write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_tensor_parallel_size": 1}})
    rc, hosts = deploy(capsys, one, "--limit", "a10-2", "--prune")
    assert rc == 0 and hosts["a10-2"]["pruned"] == ["ernie-vllm-1.service"]
    assert lab.ssh("a10-2", "test -e /etc/systemd/system/ernie-vllm-1.service").returncode != 0
    assert lab.ssh("a10-2", "systemctl is-active ernie-vllm-1.service").stdout.strip() != "active"


def test_releases_are_kept_on_the_host_and_restore_puts_files_back(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    """Each changing deploy records a release of every managed file (env files 0600); the newest
    vllm_keep_releases stay; restoring one puts its files back and marks the unit pending, so the next
    deploy restarts it to the plan even though nothing else changed."""
    from ernie_deploy.inventory.inventory import load_inventory
    from ernie_deploy.remote import releases

    def inv(length: int) -> Path:
        return write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_max_model_len": length,
                                                                "vllm_keep_releases": 2}})

    ids = []
    for length in (1024, 1152, 1280):
        rc, hosts = deploy(capsys, inv(length), "--limit", "a10-1")
        assert rc == 0 and hosts["a10-1"]["release"], hosts
        ids.append(hosts["a10-1"]["release"])
    host = load_inventory(inv(1280)).hosts["a10-1"]
    with connect(Target.from_host(host.name, host.address, host.port, host.user, host.vars)) as session:
        kept = releases.parse_list(session.run(releases.list_command()).text)
        assert [r.id for r in kept] == ids[1:]  # the oldest was removed
        assert sorted(kept[0].files) == ["/etc/ernie-deploy/ernie-vllm-0.env",
                                         "/etc/systemd/system/ernie-vllm-0.service"]
        stored = f"/var/lib/ernie-deploy/releases/{kept[0].id}/etc/ernie-deploy/ernie-vllm-0.env"
        assert lab.ssh("a10-1", f"stat -c '%a %U' {stored}").stdout.strip() == "600 root"
        session.run(releases.restore_command(kept[0], ("ernie-vllm-0.service",)))
    assert "--max-model-len 1152" in lab.ssh("a10-1", "cat /etc/systemd/system/ernie-vllm-0.service").stdout
    assert lab.ssh("a10-1", "cat /var/lib/ernie-deploy/pending").stdout.split() == ["ernie-vllm-0.service"]
    rc, hosts = deploy(capsys, inv(1280), "--limit", "a10-1")
    assert rc == 0 and hosts["a10-1"]["restarted"] == ["ernie-vllm-0.service"], hosts
    assert "--max-model-len 1280" in lab.ssh("a10-1", "cat /etc/systemd/system/ernie-vllm-0.service").stdout
    assert lab.ssh("a10-1", "cat /var/lib/ernie-deploy/pending").stdout.split() == []


def test_staged_but_not_activated_units_are_restarted_by_the_next_deploy(
        capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    """A run stopped between stage and activate: the files match the plan, but the running process does not;
    the pending list makes the next deploy restart it instead of reporting nothing to change."""
    inv = write_inventory(deployed, tmp_path, **{"a10-1": {"vllm_max_model_len": 1408}})
    rc, _ = deploy(capsys, inv, "--limit", "a10-1")
    assert rc == 0
    lab.ssh("a10-1", "echo ernie-vllm-0.service > /var/lib/ernie-deploy/pending")  # as a stopped run leaves it
    before = start_times(lab, "a10-1")
    rc, hosts = deploy(capsys, inv, "--limit", "a10-1")
    assert rc == 0 and hosts["a10-1"]["restarted"] == ["ernie-vllm-0.service"], hosts
    assert "staged by an earlier run" in hosts["a10-1"]["reasons"]["ernie-vllm-0.service"]
    assert start_times(lab, "a10-1") != before


def faults(lab: Lab, host: str, knobs: dict[str, object] | None) -> None:
    if knobs is None:
        lab.ssh(host, "rm -f /etc/ernie-lab/faults.json")
    else:
        lab.ssh(host, "mkdir -p /etc/ernie-lab && cat > /etc/ernie-lab/faults.json", input=json.dumps(knobs))


def unit_show(lab: Lab, host: str, *props: str) -> dict[str, str]:
    out = lab.ssh(host, f"systemctl show -p {','.join(props)} ernie-vllm-0.service").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def healthy(state: LabState, host: str) -> bool:
    url = f"http://{state.host(host).address}:8000/health"
    return subprocess.run(["curl", "-sf", "-o", "/dev/null", url], timeout=10).returncode == 0


def test_crash_loop_is_not_running_and_its_verdict_clears(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                          deployed: LabState, tmp_path: Path) -> None:
    """A unit that crash-loops is never "all running": with the fault removed, deploy restarts it and waits for
    readiness. And a loop that healed by itself (systemd's own restarts) stops counting once the new process
    has stayed up for the stability window: verify passes, deploy has nothing to do."""
    host = {"vllm_stable_seconds": 3}
    try:
        faults(lab, "a10-2", {"fail_startup": "traceback"})
        first = write_inventory(deployed, tmp_path, **{"a10-2": {**host, "vllm_max_model_len": 1152}})
        rc, hosts = deploy(capsys, first, "--limit", "a10-2", "--no-rollback")  # the failed state is under test
        assert rc == 2 and hosts["a10-2"]["status"] == "failed", hosts
        faults(lab, "a10-2", None)
        rc, hosts = deploy(capsys, first, "--limit", "a10-2")
        assert rc == 0 and hosts["a10-2"]["restarted"] == ["ernie-vllm-0.service"], hosts
        assert hosts["a10-2"]["message"] == "changed; every (re)started instance verified"

        # Again, but this time systemd's own restarts heal it: no deploy in between.
        faults(lab, "a10-2", {"fail_startup": "traceback"})
        inv = write_inventory(deployed, tmp_path, **{"a10-2": {**host, "vllm_max_model_len": 1280}})
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2", "--no-rollback")
        assert rc == 2
        assert wait_for(lambda: int(unit_show(lab, "a10-2", "NRestarts")["NRestarts"] or 0) >= 2, timeout=40)
        faults(lab, "a10-2", None)
        assert wait_for(lambda: healthy(deployed, "a10-2"), timeout=40)
        time.sleep(3.5)  # the stability window
        capsys.readouterr()
        rc = main(["verify", "-i", str(inv), "--limit", "a10-2", "--json"])
        (verified,) = json.loads(capsys.readouterr().out)["hosts"]
        systemd = next(c for c in verified["checks"] if c["name"] == "systemd")
        assert rc == 0 and systemd["status"] == "pass" and "earlier" in systemd["summary"], verified
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2")
        assert rc == 0 and hosts["a10-2"]["status"] == "ok", hosts
    finally:
        faults(lab, "a10-2", None)
        lab.ssh("a10-2", CLEAN)


def test_death_inside_the_stability_window_fails_the_deploy(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                           deployed: LabState, tmp_path: Path) -> None:
    """An engine that dies 3 s after becoming ready is caught by a 6 s window (vllm_stable_seconds)."""
    try:
        faults(lab, "a10-2", {"crash_after_s": 3})
        inv = write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_stable_seconds": 6, "vllm_max_model_len": 1536}})
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2")
        assert rc == 2 and hosts["a10-2"]["status"] == "failed", hosts
        assert "503" in hosts["a10-2"]["message"] or "died" in hosts["a10-2"]["message"] \
            or "Engine" in hosts["a10-2"]["message"], hosts["a10-2"]["message"]
        # A first deploy has nothing to go back to: stopped and disabled instead of crash-looping.
        assert "stopped and disabled" in hosts["a10-2"]["rollbacks"][0], hosts["a10-2"]["rollbacks"]
        state = unit_show(lab, "a10-2", "ActiveState", "UnitFileState")
        assert (state["ActiveState"], state["UnitFileState"]) == ("inactive", "disabled"), state
    finally:
        faults(lab, "a10-2", None)
        lab.ssh("a10-2", CLEAN)


def test_leftover_instances_are_listed_and_block_their_gpus(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                            deployed: LabState, tmp_path: Path) -> None:
    """Units the plan no longer has are listed by --check, deploy and verify; one on GPUs the plan needs fails
    the host before anything is changed, naming the unit and --prune."""
    two = write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_instances": 2, "vllm_tensor_parallel_size": 1,
                                                           "vllm_stable_seconds": 1}})
    try:
        rc, hosts = deploy(capsys, two, "--limit", "a10-2")
        assert rc == 0, hosts
        before = lab.ssh("a10-2", f"sha256sum {UNITS_GLOB}").stdout
        one = write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_stable_seconds": 1}})
        rc, hosts = deploy(capsys, one, "--limit", "a10-2", "--check")
        assert hosts["a10-2"]["leftover"] == ["ernie-vllm-1.service"]
        rc, hosts = deploy(capsys, one, "--limit", "a10-2")
        assert rc == 2 and "ernie-vllm-1.service is not in the plan" in hosts["a10-2"]["message"], hosts
        assert "--prune" in hosts["a10-2"]["hint"]
        assert lab.ssh("a10-2", f"sha256sum {UNITS_GLOB}").stdout == before  # nothing was changed
        capsys.readouterr()
        main(["verify", "-i", str(one), "--limit", "a10-2", "--json"])
        (verified,) = json.loads(capsys.readouterr().out)["hosts"]
        assert any(c["name"] == "leftover" and "ernie-vllm-1" in c["summary"] for c in verified["checks"]), verified
        rc, hosts = deploy(capsys, one, "--limit", "a10-2", "--prune")
        assert rc == 0 and hosts["a10-2"]["pruned"] == ["ernie-vllm-1.service"], hosts
    finally:
        lab.ssh("a10-2", CLEAN)


def test_dropins_are_drift(capsys: pytest.CaptureFixture[str], lab: Lab, deployed: LabState, tmp_path: Path) -> None:
    """A `systemctl edit` override of ExecStart is never "nothing to change": --check/--diff show it, deploy
    refuses the host naming the file, --prune removes it and restarts the unit to the plan."""
    inv = write_inventory(deployed, tmp_path, **{"a10-2": {"vllm_stable_seconds": 1}})
    dropin = "/etc/systemd/system/ernie-vllm-0.service.d/override.conf"
    try:
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2")
        assert rc == 0, hosts
        exec_start = lab.ssh("a10-2", "systemctl show -p ExecStart --value ernie-vllm-0.service").stdout
        assert "--tensor-parallel-size" in exec_start or "serve" in exec_start
        lab.ssh("a10-2", f"mkdir -p {dropin.rsplit('/', 1)[0]} && printf '[Service]\\nEnvironment=X_EDITED=1\\n' "
                         f"> {dropin} && systemctl daemon-reload")
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2", "--check", "--diff")
        assert hosts["a10-2"]["dropins"] == [dropin] and any("X_EDITED" in d for d in hosts["a10-2"]["diffs"])
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2")
        assert rc == 2 and dropin in hosts["a10-2"]["message"] and "--prune" in hosts["a10-2"]["hint"], hosts
        assert lab.ssh("a10-2", f"test -f {dropin}").returncode == 0
        rc, hosts = deploy(capsys, inv, "--limit", "a10-2", "--prune")
        assert rc == 0 and hosts["a10-2"]["restarted"] == ["ernie-vllm-0.service"], hosts
        assert lab.ssh("a10-2", f"test -e {dropin}").returncode != 0
        assert "X_EDITED" not in lab.ssh("a10-2", "systemctl show -p Environment ernie-vllm-0.service").stdout
    finally:
        lab.ssh("a10-2", f"rm -rf {dropin.rsplit('/', 1)[0]}; " + CLEAN)
