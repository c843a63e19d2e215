"""`export ansible` without hosts: what it writes (units verbatim, env templates that render to ernie-deploy's
env files, no secret value anywhere, strict host keys, the plays' batches), what it refuses, and the host
program's record (lock, release, pending list) read back by ernie-deploy's own parsers."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
import pytest
import yaml

from ernie_deploy.cli.main import main
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


def test_refuses_a_directory_that_is_not_an_export_and_replaces_an_earlier_export(tmp_path: Path) -> None:
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(mine), "--limit", GOOD]) == 5
    assert (mine / "todo.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    out = tmp_path / "x"
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(out), "--limit", GOOD]) == 0
    (out / "stale.yml").write_text("from an older export")
    assert main(["export", "ansible", "-i", str(EXAMPLE), "-o", str(out), "--limit", "gpu-a10-01.dc1"]) == 0
    assert not (out / "stale.yml").exists()
    assert sorted(p.name for p in (out / "roles/ernie_vllm/files/hosts").iterdir()) == ["gpu-a10-01.dc1"]
    assert not list(tmp_path.glob(".x*"))


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
