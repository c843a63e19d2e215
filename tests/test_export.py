"""`export ansible` without hosts: what it writes (units verbatim, env templates that render to ernie-deploy's
env files, no secret value anywhere, strict host keys, the plays' batches), what it refuses, and the host
program's record (lock, release, pending list) read back by ernie-deploy's own parsers."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
import pytest
import yaml
from conftest import needs_haproxy

from ernie_deploy.cli.main import main
from ernie_deploy.export.program import host_program
from ernie_deploy.planning.hostpaths import PENDING_FILE
from ernie_deploy.remote import lock, releases

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "inventory/example.yml"
GOOD = "!gpu-a10-05.dc1"  # the example's host with a deliberate plan error
BIN = Path(sys.executable).parent


def inventory(tmp_path: Path, **extra: Any) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["vars"].update(extra)
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_units_are_renders_verbatim_and_env_templates_render_to_the_same_env_files(tmp_path: Path) -> None:
    inv = inventory(tmp_path, vllm_api_key="sk-test-1", hf_token="hf_test_2")
    assert main(["render", "-i", str(inv), "-o", str(tmp_path / "r"), "--limit", GOOD]) == 0
    assert main(["export", "ansible", "-i", str(inv), "-o", str(tmp_path / "x"), "--limit", GOOD]) == 0
    role = tmp_path / "x/roles/ernie_vllm"
    hosts = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert hosts and sorted(p.name for p in (role / "files/hosts").iterdir()) == hosts
    # Ansible's template module: trailing newline kept, blocks trimmed.
    env = jinja2.Environment(keep_trailing_newline=True, trim_blocks=True, undefined=jinja2.StrictUndefined)
    for host in hosts:
        for unit in (tmp_path / "r" / host / "etc/systemd/system").iterdir():
            assert (role / "files/hosts" / host / unit.name).read_bytes() == unit.read_bytes()
        for env_file in (tmp_path / "r" / host / "etc/ernie-deploy").iterdir():
            template = (role / "templates/hosts" / host / f"{env_file.name}.j2").read_text()
            assert env.from_string(template).render(vllm_api_key="sk-test-1", hf_token="hf_test_2") == \
                env_file.read_text()


def test_no_secret_value_anywhere_and_one_vault_name_per_value(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["vars"]["vllm_api_key"] = "sk-group-value"
    data["all"]["vars"]["vllm_pip_index_url"] = "https://user:pw-in-url@pypi.example/simple"
    data["all"]["children"]["a100"]["hosts"]["gpu-a100-01.dc1"]["vllm_api_key"] = "sk-host-value"
    data["all"]["children"]["a100"]["vars"]["hf_token"] = "hf_group_value"
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(data))
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "host_vars/gpu-a10-01.dc1.yml").write_text("vllm_api_key: sk-in-host-vars\n")
    assert main(["export", "ansible", "-i", str(inv), "-o", str(tmp_path / "x"), "--limit", GOOD]) == 0
    written = b"".join(files_of(tmp_path / "x").values())
    for value in ("sk-group-value", "pw-in-url", "sk-host-value", "hf_group_value", "sk-in-host-vars"):
        assert value.encode() not in written, value
    out = yaml.safe_load((tmp_path / "x/inventory.yml").read_text())
    group, one_host = (out["all"]["vars"]["vllm_api_key"],
                       out["all"]["children"]["a100"]["hosts"]["gpu-a100-01.dc1"]["vllm_api_key"])
    assert group != one_host and {group, one_host} == {"{{ vault_vllm_api_key }}", "{{ vault_vllm_api_key_2 }}"}
    assert out["all"]["vars"]["vllm_pip_index_url"] == "{{ vault_vllm_pip_index_url }}"
    assert yaml.safe_load((tmp_path / "x/host_vars/gpu-a10-01.dc1.yml").read_text()) == \
        {"vllm_api_key": "{{ vault_vllm_api_key_3 }}"}
    assert sorted(out["ernie_export"]["hosts"]) == ["gpu-a10-01.dc1", "gpu-a10-02.dc1", "gpu-a10-03.dc1",
                                                    "gpu-a10-04.dc1", "gpu-a100-01.dc1"]
    names = yaml.safe_load((tmp_path / "x/vault.example.yml").read_text())
    assert set(names) == {"vault_vllm_api_key", "vault_vllm_api_key_2", "vault_vllm_api_key_3",
                          "vault_vllm_pip_index_url", "vault_hf_token"}


def test_host_keys_stay_strict(tmp_path: Path) -> None:
    inv = inventory(tmp_path, ernie_known_hosts="keys/known_hosts")
    assert main(["export", "ansible", "-i", str(inv), "-o", str(tmp_path / "x"), "--limit", GOOD]) == 0
    out = yaml.safe_load((tmp_path / "x/inventory.yml").read_text())
    assert out["all"]["vars"]["ansible_ssh_common_args"] == f"-o UserKnownHostsFile={tmp_path}/keys/known_hosts"
    cfg = (tmp_path / "x/ansible.cfg").read_text()
    assert "host_key_checking = True" in cfg and "StrictHostKeyChecking=yes" in cfg


def test_plays_take_the_restart_options(tmp_path: Path) -> None:
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(tmp_path / "x"), "--limit", GOOD,
                 "--canary", "1", "--serial", "2,50%", "--max-fail-percentage", "0"]) == 0
    for name in ("site.yml", "rolling-restart.yml"):
        (play,) = yaml.safe_load((tmp_path / "x" / name).read_text())
        assert play["serial"] == [1, 2, "50%"] and play["max_fail_percentage"] == 0
        assert play["hosts"] == "ernie_export"
    (verify,) = yaml.safe_load((tmp_path / "x/verify.yml").read_text())
    assert "serial" not in verify and verify["roles"][0]["vars"]["ernie_vllm_action"] == "verify"


def test_plan_errors_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(tmp_path / "x")]) == 1
    assert not (tmp_path / "x").exists()
    assert "gpu-a10-05.dc1" in capsys.readouterr().err


def test_refuses_a_directory_that_is_not_an_export_and_re_exports_only_its_own_files(tmp_path: Path) -> None:
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(mine), "--limit", GOOD]) == 5
    assert (mine / "todo.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    out = tmp_path / "x"
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(out), "--limit", GOOD]) == 0
    (out / "mine.yml").write_text("the user's, not the export's")
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(out), "--limit", "gpu-a10-01.dc1"]) == 0
    assert (out / "mine.yml").read_text() == "the user's, not the export's"
    # The hosts the first export had and this one has not: their files are gone (the manifest listed them).
    assert sorted(p.name for p in (out / "roles/ernie_vllm/files/hosts").iterdir()) == ["gpu-a10-01.dc1"]
    assert not list(tmp_path.glob(".x*")) and not list(out.rglob(".*.tmp*"))


def test_json_lists_what_was_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(tmp_path / "x"), "--limit", GOOD,
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ernie-deploy/export/v1" and "site.yml" in doc["files"] and len(doc["hosts"]) == 5


# --- the host program's record, read back by ernie-deploy -------------------------------------------------

@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """hostscript with every on-host path moved under tmp_path (the same layout)."""
    spec = importlib.util.spec_from_file_location("ernie_host_t", ROOT / "ernie_deploy/export/hostscript.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = str(tmp_path / "root")
    for name in ("STATE_DIR", "LOCK_DIR", "RELEASES_DIR", "PENDING_FILE", "AUDIT_LOG", "UNIT_DIR", "ENV_DIR"):
        monkeypatch.setattr(module, name, root + getattr(module, name))
    monkeypatch.setattr(module, "show", lambda unit, prop: "active" if prop == "ActiveState" else "")
    return module


def who(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(user="ops", controller="ctl", command="ansible-playbook site.yml", host="h1", **kw)


def test_lock_info_is_what_ernie_deploy_reads_and_a_second_holder_is_refused(
        host: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert host.cmd_lock(who(action="acquire", token="t1", pid=42)) == 0
    info = lock.parse_info(Path(host.LOCK_DIR, "info").read_text())
    assert info is not None and (info.token, info.user, info.controller, info.pid) == ("t1", "ops", "ctl", 42)
    assert host.cmd_lock(who(action="acquire", token="t1", pid=42)) == 0  # re-entrant for its own token
    assert host.cmd_lock(who(action="acquire", token="t2", pid=43)) == lock.HELD_EXIT
    assert "held by ops@ctl (pid 42)" in capsys.readouterr().out
    host.cmd_lock(who(action="release", token="t2", pid=0))
    assert Path(host.LOCK_DIR).exists()  # not the holder's token: kept
    host.cmd_lock(who(action="release", token="t1", pid=0))
    assert not Path(host.LOCK_DIR).exists()


def test_a_recorded_release_reads_as_ernie_deploys_and_marks_running_units_pending(
        host: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    unit, env = Path(host.UNIT_DIR, "ernie-vllm-0.service"), Path(host.ENV_DIR, "ernie-vllm-0.env")
    unit.parent.mkdir(parents=True)
    env.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/bin/old\n")
    env.write_text("# env\n")
    host.cmd_record(who(before=json.dumps({"files": {}, "units": {"ernie-vllm-0": {"active": False}}}),
                        keep=5, units=["ernie-vllm-0"]))
    capsys.readouterr()
    host.cmd_state(argparse.Namespace(units=["ernie-vllm-0"]))
    before = capsys.readouterr().out
    first = json.loads(before)["units"]["ernie-vllm-0"]["release"]
    assert first
    unit.write_text("[Service]\nExecStart=/bin/new\n")
    host.cmd_record(who(before=before, keep=5, units=["ernie-vllm-0"]))
    listing = "".join(f"{releases.MARK}{p.read_text().replace(chr(10), '')}\n"
                      for p in sorted(Path(host.RELEASES_DIR).glob("*/release.json")))
    kept = releases.parse_list(listing)
    assert len(kept) == 2 and kept[0].id == first
    newest = kept[-1]
    assert newest.command == "ansible-playbook site.yml" and newest.changed == (str(unit),)
    assert releases.current(kept, {str(unit): host.sha256(str(unit)), str(env): host.sha256(str(env))}) == newest
    assert Path(host.RELEASES_DIR, newest.id, str(unit).lstrip("/")).read_text().endswith("/bin/new\n")
    # Running and changed: pending, with the release it ran (the line format of remote/state.py).
    pending = Path(host.PENDING_FILE).read_text()
    assert pending == f"ernie-vllm-0.service {first}\n" and PENDING_FILE.endswith("/pending")
    audit = [json.loads(line) for line in Path(host.AUDIT_LOG).read_text().splitlines()]
    assert audit[-1]["action"] == "stage" and audit[-1]["restart"] == ["ernie-vllm-0.service"]
    host.cmd_started(who(unit="ernie-vllm-0", action="restart"))
    assert Path(host.PENDING_FILE).read_text() == ""


def test_ansible_lint_passes_on_the_export(tmp_path: Path) -> None:
    """The production profile of ansible-lint (offline: nothing is installed), from the export's own directory."""
    out = tmp_path / "x"
    assert main(["export", "ansible", "-i", str(inventory(tmp_path, vllm_api_key="sk-1")), "-o", str(out),
                 "--limit", GOOD, "--canary", "1"]) == 0
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "ANSIBLE_NOCOLOR": "1", "NO_COLOR": "1",
           "ANSIBLE_CONFIG": str(out / "ansible.cfg")}
    done = subprocess.run([str(BIN / "ansible-lint"), "--offline", "--nocolor", "--profile", "production"],
                          cwd=out, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_hooks_get_the_documented_command_names(tmp_path: Path) -> None:
    """ERNIE_COMMAND is what docs/hooks.md lists (deploy, restart, rollback), not the playbook's name: a hook
    author branches on the operation (issue 23, item 13)."""
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(tmp_path / "x"), "--limit", GOOD]) == 0
    (cycle,) = yaml.safe_load((tmp_path / "x/roles/ernie_vllm/tasks/cycle.yml").read_text())
    expression = cycle["vars"]["ernie_vllm_hook_env"]["ERNIE_COMMAND"]
    for name, want in (("site.yml", "deploy"), ("rolling-restart.yml", "restart")):
        (play,) = yaml.safe_load((tmp_path / "x" / name).read_text())
        role_vars = {**play["pre_tasks"][0]["ansible.builtin.set_fact"], **play["roles"][0]["vars"]}
        assert jinja2.Environment().from_string(expression).render(role_vars) == want, name


# --- balancers (group vllm_balancers): the balancer role, and the cycle driving HAProxy's runtime API ---------

def balanced_inventory(tmp_path: Path, key: str = "sk-lb-1") -> Path:
    """The example without its broken host, an API key, and two balancers: lb-1 with Debian's defaults, lb-2
    with its own configuration path and check interval."""
    data = yaml.safe_load(EXAMPLE.read_text())
    del data["all"]["children"]["a10"]["children"]["a10_quad"]["hosts"]["gpu-a10-05.dc1"]
    data["all"]["vars"]["vllm_api_key"] = key
    data["all"]["children"]["vllm_balancers"] = {"hosts": {
        "lb-1": {"ansible_host": "10.0.9.1"},
        "lb-2": {"ansible_host": "10.0.9.2", "vllm_balancer_config": "/srv/lb/haproxy.cfg",
                 "vllm_balancer_check_interval": 0.5}}}
    path = tmp_path / "balanced.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def balancer_plans(inv: Path) -> list[Any]:
    from ernie_deploy.inventory.inventory import load_inventory
    from ernie_deploy.planning.balancer import plan_balancers, split_hosts
    from ernie_deploy.planning.plan import PlanContext, plan_hosts

    vllm, balancers = split_hosts(load_inventory(inv).select(None))
    return plan_balancers(balancers, plan_hosts(list(vllm), PlanContext.load(None, base_dir=inv.parent)), inv.parent)


def test_without_balancers_the_export_holds_no_trace_of_them(tmp_path: Path) -> None:
    """An inventory without balancers exports what it exported before balancers existed: no balancer role or
    group, no region marker, no `balancers` in a host's plan, and a host program without the haproxy command."""
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(tmp_path / "x"), "--limit", GOOD]) == 0
    files = files_of(tmp_path / "x")
    assert not [p for p in files if "ernie_balancer" in p]
    text = b"".join(files.values()).decode()
    assert ">>> balancers" not in text and "<<< balancers" not in text and "ernie_balancers" not in text
    assert "haproxy" not in text.lower() and "ernie_vllm_lb_" not in text
    for path in (tmp_path / "x/roles/ernie_vllm/vars/hosts").iterdir():
        assert all("balancers" not in i for i in yaml.safe_load(path.read_text())["ernie_vllm_instances"])


def test_the_export_installs_each_balancers_rendered_config_before_the_vllm_hosts(tmp_path: Path) -> None:
    from ernie_deploy.planning.balancer import render_balancer

    inv = balanced_inventory(tmp_path)
    assert main(["export", "ansible", "-i", str(inv), "-o", str(tmp_path / "x")]) == 0
    out = tmp_path / "x"
    role = out / "roles/ernie_balancer"
    for rel in ("tasks/main.yml", "handlers/main.yml", "defaults/main.yml", "vars/hosts/lb-1.yml",
                "vars/hosts/lb-2.yml", "templates/hosts/lb-1/haproxy.cfg.j2", "templates/hosts/lb-2/haproxy.cfg.j2"):
        assert (role / rel).is_file(), rel
    assert b"sk-lb-1" not in b"".join(files_of(out).values())
    # The template is render_balancer's configuration with the key replaced by its vault variable (the one the
    # inventory's vllm_api_key became), and renders back to it.
    env = jinja2.Environment(keep_trailing_newline=True, trim_blocks=True, undefined=jinja2.StrictUndefined)
    for plan in balancer_plans(inv):
        template = (role / f"templates/hosts/{plan.host}/haproxy.cfg.j2").read_text()
        real = render_balancer(plan)
        assert template == real.replace("sk-lb-1", "{{ vault_vllm_api_key }}") and "sk-lb-1" in real
        assert env.from_string(template).render(vault_vllm_api_key="sk-lb-1") == real
        assert yaml.safe_load((role / f"vars/hosts/{plan.host}.yml").read_text())["ernie_balancer_secret_vars"] == \
            ["vault_vllm_api_key"]
    assert oct((role / "templates/hosts/lb-1/haproxy.cfg.j2").stat().st_mode & 0o777) == "0o600"
    # The balancers' play comes first in the plays that change hosts; verify.yml has only the vLLM hosts.
    for name in ("site.yml", "rolling-restart.yml"):
        plays = yaml.safe_load((out / name).read_text())
        assert [p["hosts"] for p in plays] == ["ernie_balancers", "ernie_export"]
        assert plays[0]["roles"] == [{"role": "ernie_balancer"}]
    assert [p["hosts"] for p in yaml.safe_load((out / "verify.yml").read_text())] == ["ernie_export"]
    groups = yaml.safe_load((out / "inventory.yml").read_text())
    assert sorted(groups["ernie_balancers"]["hosts"]) == ["lb-1", "lb-2"]
    assert not {"lb-1", "lb-2"} & set(groups["ernie_export"]["hosts"])
    tasks = yaml.safe_load((role / "tasks/main.yml").read_text())
    modules = {k for t in tasks for k in t if k.startswith("ansible.builtin.")}
    assert {"ansible.builtin.package", "ansible.builtin.template", "ansible.builtin.systemd_service"} <= modules
    (template_task,) = [t for t in tasks if "ansible.builtin.template" in t]
    assert template_task["ansible.builtin.template"]["validate"] == "haproxy -c -f %s"
    assert template_task["notify"] == "Ernie reload haproxy" and template_task["diff"] is False
    handlers = {h["name"]: h for h in yaml.safe_load((role / "handlers/main.yml").read_text())}
    assert handlers["Ernie reload haproxy"]["ansible.builtin.systemd_service"] == {"name": "haproxy",
                                                                                  "state": "reloaded"}


def test_a_drop_in_only_outside_debians_defaults_the_same_deploy_writes(tmp_path: Path) -> None:
    from ernie_deploy.planning.balancer import unit_dropin as dropin_text

    inv = balanced_inventory(tmp_path)
    assert main(["export", "ansible", "-i", str(inv), "-o", str(tmp_path / "x")]) == 0
    for plan in balancer_plans(inv):
        want = dropin_text(plan.config_path, os.path.dirname(plan.admin_socket))
        lines = yaml.safe_load((tmp_path / f"x/roles/ernie_balancer/vars/hosts/{plan.host}.yml").read_text())[
            "ernie_balancer_dropin"]
        assert ("\n".join(lines) + "\n" if lines else None) == want
    assert want is not None and "CONFIG=/srv/lb/haproxy.cfg" in want  # lb-2, the last


def test_each_instances_cycle_drains_and_readies_it_on_every_fronting_balancer(tmp_path: Path) -> None:
    inv = balanced_inventory(tmp_path)
    assert main(["export", "ansible", "-i", str(inv), "-o", str(tmp_path / "x"), "--limit", "gpu-a10-0*"]) == 0
    out = tmp_path / "x"
    plans = {p.host: p for p in balancer_plans(inv)}
    # --limit leaves the balancers' configuration out, not their part in the cycles: they front these instances.
    assert not (out / "roles/ernie_balancer").exists()
    assert [p["hosts"] for p in yaml.safe_load((out / "site.yml").read_text())] == ["ernie_export"]
    host_vars = yaml.safe_load((out / "roles/ernie_vllm/vars/hosts/gpu-a10-02.dc1.yml").read_text())
    (instance,) = host_vars["ernie_vllm_instances"]
    backend, server = plans["lb-1"].server_for("gpu-a10-02.dc1", 0)
    assert server.name == "gpu-a10-02.dc1-0"
    assert instance["balancers"] == [
        {"host": "lb-1", "socket": "/run/haproxy/admin.sock", "backend": backend.name, "server": server.name,
         "up_retries": 13},  # 2 × rise 2 × 2 s + 5 s
        {"host": "lb-2", "socket": "/run/haproxy/admin.sock", "backend": backend.name, "server": server.name,
         "up_retries": 7}]  # 2 × rise 2 × 0.5 s + 5 s
    (cycle,) = yaml.safe_load((out / "roles/ernie_vllm/tasks/cycle.yml").read_text())
    names = [t["name"] for t in cycle["block"]]

    def at(prefix: str) -> int:
        return next(i for i, n in enumerate(names) if n.startswith(prefix))

    # Drain on the balancers and wait for their sessions before the hook and vLLM's own drain; ready and UP after
    # verify, before the post-ready hook.
    assert at("Out of the load balancers") < at("Wait until the load balancers hold no session") < \
        at("Pre-drain hook") < at("Drain: /metrics") < at("Stop") < at("Start") < at("Verify") < \
        at("Back into the load balancers") < at("Wait until each load balancer's health check") < \
        at("Post-ready hook")
    for prefix, state in (("Out of the load balancers", "drain"), ("Back into the load balancers", "ready")):
        task = cycle["block"][at(prefix)]
        assert task["delegate_to"] == "{{ item.host }}" and task["loop"] == "{{ ernie_vllm_instance.balancers }}"
        assert task["ansible.builtin.script"]["cmd"].endswith(f" {state}")
        assert " haproxy --socket " in task["ansible.builtin.script"]["cmd"]
    wait = cycle["block"][at("Wait until the load balancers hold no session")]
    assert wait["delegate_to"] == "{{ item.host }}" and wait["retries"] == "{{ ernie_vllm_idle_timeout }}"
    rescue = [t["name"] for t in cycle["rescue"]]
    assert any(n.startswith("Back into the load balancers after the failure") for n in rescue)
    assert "still in drain on" in cycle["rescue"][-1]["ansible.builtin.fail"]["msg"]
    converge = yaml.safe_load((out / "roles/ernie_vllm/tasks/converge.yml").read_text())
    check = next(t for t in converge if t["name"].startswith("Every load balancer fronting"))
    restart = next(i for i, t in enumerate(converge) if t["name"].startswith("Restart or start"))
    assert converge.index(check) < restart and check["delegate_to"] == "{{ item.1.host }}"
    assert "def cmd_haproxy" in (out / "roles/ernie_vllm/files/ernie_host.py").read_text()


def test_the_export_with_balancers_passes_ansible_lint_and_the_syntax_check(tmp_path: Path) -> None:
    out = tmp_path / "x"
    assert main(["export", "ansible", "-i", str(balanced_inventory(tmp_path)), "-o", str(out), "--canary", "1",
                 "--pre-drain", "true", "--post-ready", "true"]) == 0
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "ANSIBLE_NOCOLOR": "1", "NO_COLOR": "1",
           "ANSIBLE_CONFIG": str(out / "ansible.cfg")}
    (tmp_path / "vault.yml").write_text("vault_vllm_api_key: sk-lb-1\n")
    for name in ("site.yml", "rolling-restart.yml", "verify.yml"):
        done = subprocess.run([str(BIN / "ansible-playbook"), name, "-e", f"@{tmp_path / 'vault.yml'}",
                               "--syntax-check"], cwd=out, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([str(BIN / "ansible-lint"), "--offline", "--nocolor", "--profile", "production"],
                          cwd=out, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.parametrize("key,safe", [("sk-plain_Key.1", True), ('sk"quote', False), ("sk\\slash", False),
                                      ("sk$HOME", False), ("sk'tick", False), ("sk\nline", False)])
def test_the_balancer_role_refuses_a_key_its_config_would_misread(key: str, safe: bool) -> None:
    """The key lands unescaped inside HAProxy's double quotes: what its quoting would change is refused by the
    role's assert (Ansible's `search` test is Python's re.search)."""
    import re

    defaults = ROOT / "ernie_deploy/export/content/roles/ernie_balancer/defaults/main.yml"
    pattern = yaml.safe_load(defaults.read_text())["ernie_balancer_unsafe_secret"]
    assert (re.search(pattern, key) is None) == safe


# --- the host program's `haproxy` command against a real HAProxy ---------------------------------------------



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def haproxy(tmp_path: Path) -> Iterator[tuple[Path, Path, int]]:
    """A real HAProxy (foreground, -db) with its admin socket in tmp_path, backend `m` with server h-0 on a port
    that listens (its TCP check passes: UP) and h-1 on one that does not (DOWN); the shipped host program, and
    the frontend's port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve() -> None:
        """Hold each connection until its far end closes, then close it: a session ends when its client goes."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: (c.recv(1), c.close()), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    sock = tmp_path / "admin.sock"
    cfg = tmp_path / "haproxy.cfg"
    frontend = free_port()
    cfg.write_text(f"""global
    stats socket {sock} mode 600 level admin
defaults
    mode tcp
    timeout connect 1s
    timeout client 10s
    timeout server 10s
frontend f
    bind 127.0.0.1:{frontend}
    default_backend m
backend m
    default-server inter 100ms fall 2 rise 2
    server h-0 127.0.0.1:{listener.getsockname()[1]} check weight 3
    server h-1 127.0.0.1:{free_port()} check
""")
    program = tmp_path / "ernie_host.py"
    program.write_text(host_program())
    proc = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            if sock.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert sock.exists(), proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else "no socket"
        yield program, sock, frontend
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        listener.close()


def haproxy_cli(program: Path, sock: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(program), "haproxy", "--socket", str(sock), *argv],
                          capture_output=True, text=True, timeout=30, check=False)


def stat_until(program: Path, sock: Path, server: str, status: str) -> dict[str, Any]:
    for _ in range(60):  # 3 s: the checks run every 100 ms
        done = haproxy_cli(program, sock, "stat", server)
        assert done.returncode == 0, done.stdout
        found: dict[str, Any] = json.loads(done.stdout)
        if found["status"] == status:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{server} never {status}: {found}")


@needs_haproxy
def test_haproxy_command_drains_and_readies_a_server_and_reads_its_sessions(
        haproxy: tuple[Path, Path, int]) -> None:
    program, sock, frontend = haproxy
    up = stat_until(program, sock, "m/h-0", "UP")
    assert up == {"backend": "m", "server": "h-0", "status": "UP", "scur": 0, "weight": 3}
    # A client's session on h-0 stays counted while it is drained: what the cycle waits on before a stop.
    with socket.create_connection(("127.0.0.1", frontend), timeout=5):
        for _ in range(60):
            if json.loads(haproxy_cli(program, sock, "stat", "m/h-0").stdout)["scur"] == 1:
                break
            time.sleep(0.05)
        done = haproxy_cli(program, sock, "set", "m/h-0", "drain")
        assert done.returncode == 0 and done.stdout.strip() == "m/h-0 drain"
        assert stat_until(program, sock, "m/h-0", "DRAIN")["scur"] == 1
    for _ in range(60):
        if json.loads(haproxy_cli(program, sock, "stat", "m/h-0").stdout)["scur"] == 0:
            break
        time.sleep(0.05)
    assert stat_until(program, sock, "m/h-0", "DRAIN")["scur"] == 0
    assert haproxy_cli(program, sock, "set", "m/h-0", "ready").returncode == 0
    stat_until(program, sock, "m/h-0", "UP")
    assert stat_until(program, sock, "m/h-1", "DOWN")["weight"] == 1


@needs_haproxy
def test_haproxy_command_fails_with_haproxys_text_on_an_unknown_server(haproxy: tuple[Path, Path, int]) -> None:
    program, sock, _ = haproxy
    done = haproxy_cli(program, sock, "set", "m/nope-0", "drain")
    assert done.returncode == 1
    assert done.stdout.strip() == "HAProxy refused `set server m/nope-0 state drain`: No such server."
    done = haproxy_cli(program, sock, "set", "other/h-0", "ready")
    assert done.returncode == 1 and done.stdout.strip().endswith(": No such backend.")
    done = haproxy_cli(program, sock, "stat", "m/nope-0")
    assert done.returncode == 1 and "show stat has no server m/nope-0" in done.stdout and "site.yml" in done.stdout


@pytest.mark.parametrize("argv,why", [
    (["set", "m/h-0 state ready\nshutdown sessions", "drain"], "HAProxy's name characters"),  # a second command
    (["set", "m-h-0", "drain"], "not BACKEND/SERVER"),
    (["set", "m/h-0"], "set needs the state"),
])
def test_haproxy_command_refuses_what_would_smuggle_or_lack_a_command(tmp_path: Path, argv: list[str],
                                                                       why: str) -> None:
    program = tmp_path / "ernie_host.py"
    program.write_text(host_program())
    done = haproxy_cli(program, tmp_path / "admin.sock", *argv)
    assert done.returncode == 2 and why in done.stdout


def test_haproxy_command_names_a_missing_socket(tmp_path: Path) -> None:
    program = tmp_path / "ernie_host.py"
    program.write_text(host_program())
    done = haproxy_cli(program, tmp_path / "none.sock", "stat", "m/h-0")
    assert done.returncode == 1
    assert done.stdout.startswith(f"no HAProxy admin socket at {tmp_path / 'none.sock'}: HAProxy is not running")


def test_the_program_without_balancers_has_no_haproxy_command(tmp_path: Path) -> None:
    program = tmp_path / "ernie_host.py"
    program.write_text(host_program(balancers=False))
    ast.parse(program.read_text(), feature_version=(3, 8))
    done = haproxy_cli(program, tmp_path / "admin.sock", "stat", "m/h-0")
    assert done.returncode == 2 and "invalid choice: 'haproxy'" in done.stderr
