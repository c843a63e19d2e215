"""An Ansible estate read as it is (issue 37): INI, directories, scripts and repeated -i through ansible-inventory,
YAML through the bundled reader with or without ansible-core, vault, templates, extra variables.

The same fleet written four ways (tests/estate.py) must render byte for byte the same; without ansible-core
(a Python that cannot find ansible-inventory, PATH without it) the YAML forms still do and the others fail naming
what to install.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from estate import FORMS, write_forms
from vaulthelp import encrypt

from ernie_deploy.cli import inventories
from ernie_deploy.cli.main import main
from ernie_deploy.inventory.ansiblelist import from_ansible_list
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.inventory.yamlfile import to_json

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "estate-api-key-4f1d9c"
HF_TOKEN = "hf_estateToken7b2e"
PASSWORD = "estate-vault-pass"
FLEET: dict[str, Any] = {"all": {
    "vars": {"ansible_user": "deploy", "vllm_model": "/models/ERNIE-4.5-0.3B-PT",
             "hf_token": "{{ lookup('env', 'ESTATE_HF_TOKEN') }}"},
    "children": {
        "a10": {
            "hosts": {"gpu-a10-01": {"ansible_host": "127.0.0.41", "gpu_count": 1},
                      "gpu-a10-02": {"ansible_host": "127.0.0.42", "gpu_count": 2}},
            "vars": {"gpu_model": "NVIDIA A10", "model_alias": "ernie-small",
                     "vllm_served_model_name": "{{ model_alias }}", "vllm_port": 8001,
                     "vllm_allow_fallback": True},
        },
        "a100": {
            "hosts": {"gpu-a100-01": {"ansible_host": "127.0.0.43"}},
            "vars": {"gpu_model": "NVIDIA A100-SXM4-80GB", "gpu_count": 2, "vllm_gpu_memory_utilization": 0.85},
        },
    },
}}
SECRETS = {"a10": {"vllm_api_key": API_KEY}, "a100": {"vllm_api_key": API_KEY}}


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return write_forms(tmp_path_factory.mktemp("estate"), FLEET, SECRETS, PASSWORD)


@pytest.fixture(autouse=True)
def hf_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESTATE_HF_TOKEN", HF_TOKEN)
    monkeypatch.delenv(inventories.READER_ENV, raising=False)


def render(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["render", *args, "-o", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err


def same_tree(a: Path, b: Path) -> list[str]:
    """Files that differ or exist in one tree only."""
    left = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    right = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    differ = [str(p) for p in sorted(left & right) if not filecmp.cmp(a / p, b / p, shallow=False)]
    return differ + [str(p) for p in sorted(left ^ right)]


def test_every_form_renders_byte_identical(forms: dict[str, list[str]], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    for form in FORMS:
        render(forms[form], tmp_path / form, capsys)
    env = (tmp_path / "yaml" / "gpu-a10-02" / "etc" / "ernie-deploy").glob("*.env")
    text = "".join(p.read_text() for p in env)
    assert f"VLLM_API_KEY='{API_KEY}'" in text and f"HF_TOKEN='{HF_TOKEN}'" in text
    unit = next((tmp_path / "yaml" / "gpu-a10-02" / "etc" / "systemd" / "system").glob("*.service")).read_text()
    assert "--served-model-name ernie-small" in unit and "--port 8001" in unit
    for form in FORMS[1:]:
        assert same_tree(tmp_path / "yaml", tmp_path / form) == [], form


@pytest.mark.parametrize("fixture", sorted(p.name for p in (ROOT / "tests/fixtures/inventories").iterdir()))
def test_both_readers_give_the_same_hosts_and_variables(fixture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled reader and ansible-inventory agree on every YAML inventory of the suite (values compared as JSON
    writes them: ansible-inventory's output has only string keys and ISO dates)."""
    path = ROOT / "tests/fixtures/inventories" / fixture / "inventory.yml"
    bundled = load_inventory(path)
    monkeypatch.setenv(inventories.READER_ENV, "ansible")
    through = inventories._read(inventories.Sources((str(path),)), None)
    if fixture == "ranges_ungrouped":
        # Hosts written directly under `all` come first in Ansible's order, but ansible-inventory's JSON lists
        # them only in `ungrouped`: the one order that path cannot tell (inventory/ansiblelist.py).
        assert sorted(through.hosts) == sorted(bundled.hosts)
    else:
        assert list(through.hosts) == list(bundled.hosts)
    for name, host in bundled.hosts.items():
        assert to_json(dict(through.hosts[name].vars)) == to_json(dict(host.vars)), name
        assert through.hosts[name].groups == host.groups, name


def test_repeated_sources_merge_in_order_as_ansible_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    for folder, port, extra in ((first, 8001, "a"), (second, 8002, "b")):
        (folder / "group_vars").mkdir(parents=True)
        (folder / "hosts.yml").write_text(f"gpu:\n  hosts:\n    h1:\n    h-{extra}:\n  vars:\n    vllm_port: {port}\n")
        (folder / "group_vars" / "all.yml").write_text(f"only_{extra}: 1\nshared: {extra}\n")
        (folder / "group_vars" / "gpu.yml").write_text(f"gv_{extra}: 2\ngv_shared: {extra}\n")
    sources = inventories.Sources((str(first / "hosts.yml"), str(second / "hosts.yml")))
    bundled = inventories._read(sources, None)
    monkeypatch.setenv(inventories.READER_ENV, "ansible")
    through = inventories._read(sources, None)
    assert list(bundled.hosts) == list(through.hosts) == ["h1", "h-a", "h-b"]
    for name in bundled.hosts:
        assert dict(bundled.hosts[name].vars) == dict(through.hosts[name].vars), name
    assert bundled.hosts["h1"].vars["vllm_port"] == 8002 and bundled.hosts["h1"].vars["shared"] == "b"


def test_a_second_inventory_no_longer_replaces_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.yml").write_text("a10:\n  hosts:\n    h1: {gpu_model: NVIDIA A10, gpu_count: 1}\n")
    (tmp_path / "b.yml").write_text("a10:\n  hosts:\n    h2: {gpu_model: NVIDIA A10, gpu_count: 1}\n")
    assert main(["plan", "-i", str(tmp_path / "a.yml"), "-i", str(tmp_path / "b.yml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in doc["hosts"]] == ["h1", "h2"]


# -- without ansible-core -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def python_without_ansible(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """A Python that has ernie-deploy's dependencies but no ansible-inventory beside it or on PATH: the
    controller of an operator without ansible-core."""
    venv = tmp_path_factory.mktemp("no-ansible") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "ernie-deps.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{ROOT}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "ERNIE_"))}
    env["PATH"] = "/usr/bin:/bin"
    env["ESTATE_HF_TOKEN"] = HF_TOKEN
    yield str(venv / "bin" / "python"), env


def test_without_ansible_core_yaml_forms_render_and_others_name_the_fix(
        forms: dict[str, list[str]], python_without_ansible: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    python, env = python_without_ansible
    found = subprocess.run([python, "-c", "from ernie_deploy.cli.inventories import ansible_inventory as a; "
                            "print(a())"], capture_output=True, text=True, env=env, timeout=60)
    assert found.stdout.strip() == "None", found.stderr
    for form in FORMS:
        proc = subprocess.run([python, "-m", "ernie_deploy", "render", *forms[form], "-o", str(tmp_path / form)],
                              capture_output=True, text=True, env=env, timeout=120)
        if form in ("yaml", "dir"):
            assert proc.returncode == 0, proc.stderr
        else:
            kind = "an INI inventory" if form == "ini" else "an executable inventory script"
            assert proc.returncode == 5 and f"{kind} needs ansible-inventory" in proc.stderr, proc.stderr
            assert "pip install ansible-core" in proc.stderr
    assert same_tree(tmp_path / "yaml", tmp_path / "dir") == []


# -- ansible-inventory's failures ------------------------------------------------------------------------------

def test_a_failing_dynamic_source_is_its_error_and_nothing_half_read(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.ini"
    good.write_text("[a10]\nh1 gpu_model='NVIDIA A10' gpu_count=1\n")
    script = tmp_path / "netbox.py"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('netbox.example: connection refused\\n')\n"
                      "sys.exit(1)\n")
    script.chmod(0o755)
    rc = main(["plan", "-i", str(good), "-i", str(script)])
    err = capsys.readouterr().err
    assert rc == 5
    assert "ansible-inventory failed" in err and "connection refused" in err and str(script) in err
    assert "h1" not in capsys.readouterr().out


def test_a_broken_ini_source_names_it_with_exit_5(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "hosts.ini"
    bad.write_text("[a10\nh1\n")
    assert main(["plan", "-i", str(bad)]) == 5
    err = capsys.readouterr().err
    assert "ansible-inventory failed" in err and "hosts.ini" in err


def test_duplicate_yaml_keys_give_ansible_cores_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "inventory.yml"
    path.write_text("all:\n  hosts:\n    h1:\n      vllm_port: 8001\n      vllm_port: 8002\n")
    bundled = load_inventory(path)
    monkeypatch.setenv(inventories.READER_ENV, "ansible")
    through = inventories._read(inventories.Sources((str(path),)), None)
    assert bundled.hosts["h1"].vars["vllm_port"] == through.hosts["h1"].vars["vllm_port"] == 8002


def test_ansible_markers_come_back_as_the_bundled_readers_types() -> None:
    inventory = from_ansible_list({
        "_meta": {"hostvars": {"h1": {"k": {"__ansible_vault": "$ANSIBLE_VAULT;1.1;AES256\n00\n"},
                                      "u": {"__ansible_unsafe": "{{ x }}"}}}},
        "all": {"children": ["ungrouped", "g"]}, "g": {"hosts": ["h1"]}}, "src")
    assert inventory.ansible_host("h1") == {"k": {"__ansible_vault": "$ANSIBLE_VAULT;1.1;AES256\n00\n"},
                                            "u": "{{ x }}"}
    assert inventory.hosts["h1"].groups == ("g",)


# -- vault -----------------------------------------------------------------------------------------------------

def test_a_vaulted_value_without_a_password_names_host_variable_and_how(
        forms: dict[str, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", forms["yaml"][0], forms["yaml"][1], "--limit", "gpu-a10-01", "--json"]) == 1
    out = capsys.readouterr().out
    (host,) = json.loads(out)["hosts"]
    (finding,) = [f for f in host["findings"] if f["severity"] == "error"]
    assert host["host"] == "gpu-a10-01" and finding["message"].startswith("variable vllm_api_key (from ")
    assert "no vault password was given" in finding["message"] and "--vault-password-file" in finding["fix"]
    assert "$ANSIBLE_VAULT" not in out


def test_a_vaulted_file_without_a_password_is_an_error_naming_it(forms: dict[str, list[str]],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-i", forms["dir"][1]]) == 5
    err = capsys.readouterr().err
    assert "group_vars" in err and "encrypted with ansible-vault" in err and "--vault-id" in err


def test_a_wrong_password_is_clear(forms: dict[str, list[str]], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    assert main(["plan", "-i", forms["yaml"][1], "--vault-password-file", str(wrong), "--json"]) == 1
    out = capsys.readouterr().out
    assert "no vault password given decrypts variable vllm_api_key" in out
    assert API_KEY not in out and "not-the-password" not in out


def test_vault_ids_and_the_environment_variable(forms: dict[str, list[str]], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    password_file = forms["yaml"][3]
    assert main(["plan", "-i", forms["ini"][1], "--vault-id", f"prod@{password_file}"]) == 0
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", password_file)
    assert main(["plan", "-i", forms["script"][1]]) == 0
    capsys.readouterr()


# -- templates -------------------------------------------------------------------------------------------------

def inventory_with(tmp_path: Path, variables: str) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text("a10:\n  hosts:\n    h1:\n      gpu_model: NVIDIA A10\n      gpu_count: 1\n"
                    + "".join(f"      {line}\n" for line in variables.splitlines()))
    return path


def explain(path: Path, capsys: pytest.CaptureFixture[str], *more: str) -> tuple[int, dict[str, Any], str]:
    rc = main(["explain", "-i", str(path), *more, "h1", "--json"])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out) if captured.out.strip() else {}, captured.err


def setting(doc: dict[str, Any], name: str) -> Any:
    return doc["settings"][name]["value"]


def test_templates_render_with_lookups_and_filters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ESTATE_PORT", "8011")
    (tmp_path / "name.txt").write_text("from-file\n")
    path = inventory_with(tmp_path, "vllm_port: \"{{ lookup('env', 'ESTATE_PORT') | int }}\"\n"
                                    "vllm_served_model_name: \"{{ lookup('file', 'name.txt') }}-{{ "
                                    "inventory_hostname }}\"\n"
                                    "vllm_allow_fallback: \"{{ 'yes' | bool }}\"\n"
                                    "vllm_drain_timeout: \"{{ undefined_var | default(64) }}\"\n"
                                    "vllm_env: {A: \"{{ lookup('env', 'NOT_SET_HERE', default='d') }}\"}\n"
                                    "literal: !unsafe \"{{ not templated }}\"")
    rc, doc, err = explain(path, capsys)
    assert rc == 0, err
    assert setting(doc, "port") == 8011 and setting(doc, "served_model_name") == "from-file-h1"
    assert setting(doc, "allow_fallback") is True and setting(doc, "drain_timeout") == 64
    assert setting(doc, "env") == {"A": "d"}


@pytest.mark.parametrize(("variables", "message", "fix"), [
    ("vllm_port: \"{{ nowhere }}\"", "'nowhere' is undefined", "default"),
    ("vllm_port: \"{{ lookup('pipe', 'id') }}\"", "the lookup 'pipe' is not supported", "env, file"),
    ("vllm_port: \"{{ 8000 | to_nice_yaml }}\"", "the filter 'to_nice_yaml' is not supported", "b64encode"),
    ("vllm_port: \"{{ vllm_port }}\"", "refers to itself", "loop"),
    ("vllm_port: \"{{ ''.__class__.__mro__ }}\"", "not allowed", "filters and lookups"),
    ("vllm_port: \"{{ lookup('file', 'missing.txt') }}\"", "cannot read", "readable"),
    ("vllm_port: \"{{ 8000\"", "template syntax error", "Jinja"),
])
def test_bad_templates_name_the_host_file_and_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      variables: str, message: str, fix: str) -> None:
    path = inventory_with(tmp_path, variables)
    assert main(["plan", "-i", str(path), "--json"]) == 1
    (host,) = json.loads(capsys.readouterr().out)["hosts"]
    (finding,) = [f for f in host["findings"] if f["severity"] == "error"]
    assert host["host"] == "h1" and finding["message"].startswith(f"variable vllm_port (from {path}, host h1): ")
    assert message in finding["message"] and fix in finding["fix"]


# -- extra variables and INI strings ---------------------------------------------------------------------------

def test_extra_vars_win_in_every_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = inventory_with(tmp_path, "vllm_port: 8001\nvllm_drain_timeout: 16")
    (tmp_path / "more.yml").write_text("vllm_drain_timeout: 32\n")
    rc, doc, err = explain(path, capsys, "-e", "vllm_port=8020 vllm_allow_fallback=yes",
                           "-e", '{"vllm_served_model_name": "{{ inventory_hostname }}-x"}',
                           "-e", f"@{tmp_path / 'more.yml'}")
    assert rc == 0, err
    assert setting(doc, "port") == 8020 and setting(doc, "allow_fallback") is True
    assert setting(doc, "served_model_name") == "h1-x" and setting(doc, "drain_timeout") == 32


@pytest.mark.parametrize(("option", "message"), [
    ("vllm_port", "word 1 is not key=value"),
    ("[1, 2]", "must be a mapping"),
    ("./vars.yml", "must start with @"),
    ("{bad: [", "invalid YAML/JSON"),
])
def test_bad_extra_vars_are_clear_and_never_echoed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   option: str, message: str) -> None:
    path = inventory_with(tmp_path, "")
    assert main(["plan", "-i", str(path), "-e", option]) == 5
    err = capsys.readouterr().err
    assert message in err and "-e/--extra-vars #1" in err


def test_ini_strings_are_typed_as_ansible_modules_type_them(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hosts.ini"
    path.write_text("[a10]\nh1\n[a10:vars]\ngpu_model=NVIDIA A10\ngpu_count='1'\nvllm_port='8003'\n"
                    "vllm_allow_fallback=yes\nvllm_gpu_memory_utilization='0.8'\n")
    rc, doc, err = explain(path, capsys)
    assert rc == 0, err
    assert setting(doc, "port") == 8003 and setting(doc, "allow_fallback") is True
    assert setting(doc, "gpu_memory_utilization") == 0.8
    bad = tmp_path / "bad.ini"
    bad.write_text("[a10]\nh1\n[a10:vars]\ngpu_model=NVIDIA A10\ngpu_count=1\nvllm_allow_fallback=maybe\n")
    assert main(["plan", "-i", str(bad)]) == 1
    assert "vllm_allow_fallback must be bool, got str 'maybe'" in capsys.readouterr().out


def test_extra_vars_win_over_a_plays_vars_which_win_over_the_inventory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fakehost import FakeHost, connector

    import ernie_deploy.cli.run as cli_run
    fakes = {"a": FakeHost(), "b": FakeHost()}
    monkeypatch.setattr(cli_run, "connector", lambda args: connector(fakes))
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  vars: {gpu_model: NVIDIA A10, gpu_count: 2, ansible_host: 127.0.0.1, vllm_port: 8001,\n"
                   "         vllm_stable_seconds: 0, vllm_served_model_name: '{{ inventory_hostname }}-inv'}\n"
                   "  hosts: {a: {}, b: {}}\n")
    book = tmp_path / "site.yml"
    book.write_text("- hosts: all\n  vars: {vllm_port: 8010, vllm_served_model_name: '{{ inventory_hostname }}-play'}\n"
                    "  tasks:\n    - converge: {}\n")
    assert main(["run", str(book), "-i", str(inv), "-e", "vllm_port=8020"]) == 0, capsys.readouterr().out
    unit = fakes["b"].files["/etc/systemd/system/ernie-vllm-0.service"]
    assert "--port 8020" in unit and "--served-model-name b-play" in unit


@pytest.mark.parametrize("form", ["ini", "dir", "script"])
def test_the_export_of_any_form_is_an_inventory_ansible_reads_with_no_secret_in_it(
        form: str, forms: dict[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "ansible", *forms[form], "-o", str(tmp_path / "x")]) == 0, capsys.readouterr().err
    exported = tmp_path / "x" / "inventory.yml"
    assert API_KEY not in exported.read_text()
    listed = subprocess.run([str(inventories.ansible_inventory()), "-i", str(exported), "--list"],
                            capture_output=True, text=True, timeout=120, check=True)
    hostvars = json.loads(listed.stdout)["_meta"]["hostvars"]
    assert sorted(hostvars) == ["gpu-a10-01", "gpu-a10-02", "gpu-a100-01"]
    assert hostvars["gpu-a10-02"]["gpu_count"] == 2 and hostvars["gpu-a10-02"]["vllm_port"] == 8001
    assert hostvars["gpu-a10-02"]["vllm_api_key"] == "{{ vault_vllm_api_key }}"
    assert hostvars["gpu-a10-02"]["hf_token"] == "{{ lookup('env', 'ESTATE_HF_TOKEN') }}"
    assert "vault_vllm_api_key: CHANGE_ME" in (tmp_path / "x" / "vault.example.yml").read_text()


def test_an_unused_vaulted_variable_needs_no_password_and_a_prompt_asks_once(
        forms: dict[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As in Ansible, a value is decrypted where it is used: a vaulted become password ernie-deploy never reads
    needs no vault password; and a prompt for one is asked once per command, though export reads twice."""
    path = tmp_path / "inventory.yml"
    secret = encrypt(b"become-pass", PASSWORD.encode()).replace("\n", "\n        ")
    path.write_text("a10:\n  hosts:\n    h1:\n      gpu_model: NVIDIA A10\n      gpu_count: 1\n"
                    f"      ansible_become_password: !vault |\n        {secret}\n")
    assert main(["plan", "-i", str(path)]) == 0, capsys.readouterr().out
    from ernie_deploy.cli import vaultpass
    asked: list[str] = []
    real = vaultpass.vault_secrets

    def counted(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "prompt": lambda text: asked.append(text) or PASSWORD})

    monkeypatch.setattr(vaultpass, "vault_secrets", counted)
    assert main(["export", "ansible", "-i", forms["ini"][1], "--ask-vault-pass", "-o", str(tmp_path / "x")]) == 0
    assert asked == ["Vault password: "]


def test_a_secret_from_an_unset_environment_variable_is_an_error_not_an_open_server(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = inventory_with(tmp_path, "vllm_api_key: \"{{ lookup('env', 'NOT_SET_ANYWHERE') }}\"\n"
                                    "hf_token: \"{{ lookup('env', 'NOT_SET_EITHER') }}\"")
    assert main(["plan", "-i", str(path), "--json"]) == 1
    (host,) = json.loads(capsys.readouterr().out)["hosts"]
    errors = {f["message"]: f["fix"] for f in host["findings"] if f["severity"] == "error"}
    assert "vllm_api_key is empty" in errors and "environment variable" in errors["vllm_api_key is empty"]


def test_explain_names_the_file_and_group_or_host_that_set_each_value(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "a10.yml").write_text("vllm_port: 8004\n")
    path = tmp_path / "inventory.yml"
    path.write_text("a10:\n  vars:\n    vllm_drain_timeout: 12\n  hosts:\n"
                    "    h1: {gpu_model: NVIDIA A10, gpu_count: 1, vllm_stable_seconds: 3}\n")
    rc, doc, err = explain(path, capsys, "-e", "vllm_startup_budget=90")
    assert rc == 0, err
    where = {k: v.get("where") for k, v in doc["settings"].items()}
    assert where["port"] == f"{tmp_path / 'group_vars' / 'a10.yml'}, group a10"
    assert where["drain_timeout"] == f"{path}:3, group a10"
    assert where["stable_seconds"] == f"{path}, host h1"
    assert where["startup_budget"] == "-e/--extra-vars" and where["max_model_len"] is None
