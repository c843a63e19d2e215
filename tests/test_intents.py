"""What the orchestration asks a host to do, read from the commands' intents (not their shell text): which
release a failed start goes back to, what a stage marks pending, which lock is taken and released."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fakehost import FakeHost, connector

from ernie_deploy.inventory.inventory import Host, load_inventory
from ernie_deploy.orchestration.cycle import CycleOptions
from ernie_deploy.orchestration.deploy import Options, Runner
from ernie_deploy.orchestration.results import Status
from ernie_deploy.planning.plan import PlanContext
from ernie_deploy.remote import probe, releases
from ernie_deploy.remote.command import Intent, Op
from ernie_deploy.remote.converge import Activate, Stage
from ernie_deploy.remote.facts import Facts
from ernie_deploy.remote.lock import Acquire, ReleaseLock
from ernie_deploy.remote.releases import Restore, Undo

TWO = {"vllm_instances": 2, "vllm_tensor_parallel_size": 1}
UNIT = "/etc/systemd/system/ernie-vllm-{}.service"
ENV = "/etc/ernie-deploy/ernie-vllm-{}.env"


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "rollouts"))


def hosts_of(tmp_path: Path, host_vars: dict[str, object]) -> list[Host]:
    data = {"all": {"vars": {"gpu_model": "NVIDIA A10", "gpu_count": 2, "ansible_host": "127.0.0.1",
                             "vllm_host": "127.0.0.1"}, "hosts": {"a": host_vars}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return list(load_inventory(path).select(None))


def deploy(fake: FakeHost, hosts: list[Host]) -> Status:
    cycle = CycleOptions(idle_timeout=2.0, gpu_timeout=0.3, poll=0.01)
    opts = Options(health_timeout=5.0, stable=0.0, poll=0.01, cycle=cycle)
    (result,) = Runner(PlanContext.load(), connector({"a": fake}), opts).run(hosts)
    return result.status


def sent(fake: FakeHost, kind: type[Intent]) -> list[Intent]:
    return [c.intent for c in fake.received if isinstance(c.intent, kind)]


def test_a_failed_start_puts_each_unit_back_to_the_release_it_ran(tmp_path: Path) -> None:
    fake = FakeHost()
    deploy(fake, hosts_of(tmp_path, TWO))
    ran = str(fake.releases[-1]["id"])
    fake.received.clear()
    fake.fail_start = "--max-model-len 2048"
    assert deploy(fake, hosts_of(tmp_path, {**TWO, "vllm_max_model_len": 2048})) is Status.FAILED
    (undo,) = sent(fake, Undo)
    assert isinstance(undo, Undo)
    # Both units go back (the second was staged, never started), each to the release it ran, with its own
    # files only; the one that failed is stopped (started again once its GPUs are free), nothing is disabled.
    assert undo.back == {f"ernie-vllm-{i}.service": Restore(ran, (ENV.format(i), UNIT.format(i))) for i in (0, 1)}
    assert undo.stop == ("ernie-vllm-0.service",) and undo.disable == ()
    assert undo.units == ("ernie-vllm-0.service", "ernie-vllm-1.service")
    assert undo.audit["action"] == "rollback"
    # The release that failed to start is marked, naming the unit and vLLM's error.
    assert undo.failed is not None and undo.failed[0] == str(fake.releases[-1]["id"]) != ran
    assert undo.failed[1].units == ("ernie-vllm-0.service",) and "CUDA out of memory" in undo.failed[1].reason


def test_a_failed_first_deploy_disables_what_it_started(tmp_path: Path) -> None:
    fake = FakeHost(fail_start="vllm")
    assert deploy(fake, hosts_of(tmp_path, {})) is Status.FAILED
    (undo,) = sent(fake, Undo)
    assert isinstance(undo, Undo)
    assert undo.back == {} and undo.stop == () and undo.disable == ("ernie-vllm-0.service",)
    assert undo.failed is not None and undo.failed[0] == str(fake.releases[-1]["id"])


def test_a_stage_marks_its_units_pending_with_the_release_they_run(tmp_path: Path) -> None:
    fake = FakeHost()
    deploy(fake, hosts_of(tmp_path, TWO))
    ran = str(fake.releases[-1]["id"])
    fake.received.clear()
    deploy(fake, hosts_of(tmp_path, {**TWO, "vllm_max_model_len": 2048}))
    (stage,) = sent(fake, Stage)
    assert isinstance(stage, Stage)
    assert [f.path for f in stage.files] == [UNIT.format(0), UNIT.format(1)]  # the env files did not change
    assert stage.pending == {"ernie-vllm-0.service": ran, "ernie-vllm-1.service": ran}
    assert ran in stage.protect and stage.release == fake.releases[-1]["id"]
    assert stage.managed == (UNIT.format(0), ENV.format(0), UNIT.format(1), ENV.format(1))


def test_the_lock_is_taken_with_the_facts_and_released_with_the_same_token(tmp_path: Path) -> None:
    fake = FakeHost()
    deploy(fake, hosts_of(tmp_path, {}))
    (acquire,) = sent(fake, Acquire)
    (release,) = sent(fake, ReleaseLock)
    assert isinstance(acquire, Acquire) and isinstance(release, ReleaseLock)
    assert isinstance(acquire.then, Facts) and acquire.op is Op.LOCK_FACTS
    assert release.token == acquire.info.token and fake.lock_info is None


def test_restoring_one_instance_puts_back_only_its_files() -> None:
    files = {UNIT.format(i): "x" for i in (0, 1)} | {ENV.format(i): "y" for i in (0, 1)}
    release = releases.Release("20261101T000000.000Z-abc", "", "", "", files, ())
    restore = releases.restore_command(release, ("ernie-vllm-1.service",)).intent
    assert restore == Restore("20261101T000000.000Z-abc", (ENV.format(1), UNIT.format(1)))
    assert isinstance(restore, Restore) and restore.units == ("ernie-vllm-1.service",)


def test_the_script_and_the_label_come_from_the_intent() -> None:
    cmd = probe.watch_command("ernie-vllm-0.service", invocation="abc", cursor=None, requests=[], api_key=None)
    assert cmd.script == cmd.intent.render() and "ernie-vllm-0.service" in cmd.script
    assert cmd.label == "watch instance ernie-vllm-0.service" and cmd.op is Op.WATCH


@pytest.mark.parametrize("forced", [True, False])
def test_an_activation_reloads_systemd_at_most_once(forced: bool) -> None:
    """enable reloads the manager itself unless given --no-reload: with a reload of our own due (forced, or
    asked of systemd for the written unit files) it goes first and reloads nothing (a reload took 75-100 ms on a
    lab host)."""
    units = ("ernie-vllm-0.service", "ernie-vllm-1.service")
    script = Activate(units, {}, enable=units, daemon_reload=forced, written=units).render()
    lines = script.splitlines()
    enable = next(k for k, c in enumerate(lines) if c.startswith("systemctl enable "))
    start = next(k for k, c in enumerate(lines) if c.startswith("systemctl start "))
    assert "--no-reload" in lines[enable].split() and all(u in lines[enable] for u in units)
    reloads = [k for k, c in enumerate(lines) if "systemctl daemon-reload" in c]
    assert reloads == [enable + 1] and enable < start
    assert (lines[enable + 1] == "systemctl daemon-reload") is forced
    plain = Activate(units, {}, enable=units).render()
    assert "daemon-reload" not in plain and "--no-reload" not in plain  # enable reloads for itself


@pytest.mark.parametrize(("show", "reloads"), [
    ("loaded\nno\n\nloaded\nno\n", False),  # new units: systemd read them from disk on the query
    ("loaded\nyes\n\nloaded\nno\n", True),  # one it holds from an older file
    ("not-found\nno\n\nloaded\nno\n", True),  # one it keeps as missing
    ("", True),  # no answer
])
def test_systemd_reloads_only_when_it_holds_an_older_or_missing_unit_file(tmp_path: Path, show: str,
                                                                           reloads: bool) -> None:
    import subprocess

    log = tmp_path / "calls"
    (tmp_path / "systemctl").write_text(
        f"#!/bin/sh\necho \"$1\" >> {log}\ncase $1 in show) printf '{show}'; [ -n '{show}' ];; esac\n")
    (tmp_path / "systemctl").chmod(0o755)
    units = ("ernie-vllm-0.service", "ernie-vllm-1.service")
    script = Activate((), {}, written=units).render()
    script = script[:script.index("mkdir -p")]  # the audit line writes under /var/log
    done = subprocess.run(["sh", "-c", script], env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert ("daemon-reload" in log.read_text().split()) is reloads
