"""A secret never shows, whatever its source (issue 37): a known value is planted through vault (a value and a
whole group_vars file), lookup('env'), lookup('file'), a secret file variable and `-e @vaulted-file`; then every
command's output (text and --json, --diff, errors), every file the tool writes on the controller (render, export,
resume state) and every command line sent to a host are searched for it. Only the rendered env file and the
stdin that carries it to the host may hold it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fakehost import FakeHost, connector
from vaulthelp import encrypt

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode

SECRET = "planted-Secret-93c1e7"
PASSWORD = "leak-test-pass"
HOST = "a:\n  hosts:\n    h1:\n      ansible_host: 127.0.0.1\n      gpu_model: NVIDIA A10\n      gpu_count: 2\n" \
       "      vllm_stable_seconds: 0\n"


def vaulted(text: str) -> str:
    return encrypt(text.encode(), PASSWORD.encode())


def indented(block: str, spaces: int) -> str:
    return "".join(" " * spaces + line + "\n" for line in block.splitlines())


def by_vault_value(d: Path) -> list[str]:
    (d / "inv.yml").write_text(HOST + "      vllm_api_key: !vault |\n" + indented(vaulted(SECRET), 8))
    return ["-i", str(d / "inv.yml")]


def by_vault_file(d: Path) -> list[str]:
    (d / "inv").mkdir()
    (d / "inv" / "hosts.yml").write_text(HOST)
    (d / "inv" / "group_vars").mkdir()
    (d / "inv" / "group_vars" / "a.yml").write_text(vaulted(f"hf_token: {SECRET}\n"))
    return ["-i", str(d / "inv")]


def by_env(d: Path) -> list[str]:
    (d / "inv.yml").write_text(HOST + "      vllm_api_key: \"{{ lookup('env', 'PLANTED') }}\"\n")
    return ["-i", str(d / "inv.yml")]


def by_file_lookup(d: Path) -> list[str]:
    (d / "key").write_text(SECRET + "\n")
    (d / "inv.yml").write_text(HOST + "      vllm_api_key: \"{{ lookup('file', 'key') }}\"\n")
    return ["-i", str(d / "inv.yml")]


def by_secret_file(d: Path) -> list[str]:
    (d / "key").write_text(SECRET + "\n")
    (d / "inv.yml").write_text(HOST + f"      vllm_api_key_file: {d / 'key'}\n")
    return ["-i", str(d / "inv.yml")]


def by_extra_vars_file(d: Path) -> list[str]:
    (d / "inv.yml").write_text(HOST)
    (d / "extra.yml").write_text(vaulted(f"vllm_api_key: {SECRET}\n"))
    return ["-i", str(d / "inv.yml"), "-e", f"@{d / 'extra.yml'}"]


def by_ini_and_vault_file(d: Path) -> list[str]:
    (d / "hosts.ini").write_text("[a]\nh1 ansible_host=127.0.0.1 gpu_model='NVIDIA A10' gpu_count=2 "
                                 "vllm_stable_seconds=0\n")
    (d / "group_vars").mkdir()
    (d / "group_vars" / "a.yml").write_text(vaulted(f"vllm_api_key: {SECRET}\n"))
    return ["-i", str(d / "hosts.ini")]


SOURCES: dict[str, Callable[[Path], list[str]]] = {
    "vault value": by_vault_value, "vault file": by_vault_file, "env lookup": by_env,
    "file lookup": by_file_lookup, "secret file variable": by_secret_file, "-e @vaulted file": by_extra_vars_file,
    "INI with a vaulted group_vars file": by_ini_and_vault_file,
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_planted_secret_shows_nowhere_but_the_env_file(source: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PLANTED", SECRET)
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(tmp_path / "pw"))
    src = tmp_path / "src"
    src.mkdir()
    inv = SOURCES[source](src)
    fake = FakeHost()
    monkeypatch.setattr("ernie_deploy.cli.remote.connector", lambda args: connector({"h1": fake}))
    shown: list[str] = []

    def run(*argv: str, rc: int = ExitCode.OK) -> None:
        got = main([*argv[:1], *inv, *argv[1:]])
        captured = capsys.readouterr()
        shown.append(captured.out + captured.err)
        assert got == rc, (argv, captured.out, captured.err)

    run("plan")
    run("plan", "--json")
    run("plan", "-v")
    run("explain", "h1")
    run("explain", "h1", "--json")
    run("inventory", "--list")
    run("inventory", "--host", "h1")
    run("inventory", "--graph", "--vars")
    run("render", "-o", str(tmp_path / "out"))
    run("export", "ansible", "-o", str(tmp_path / "export"))
    run("deploy", "--json")
    run("deploy", "--diff")
    run("deploy", "--check", "--diff", "-e", "vllm_port=8005", rc=ExitCode.OK)
    run("releases", "--json")
    run("plan", "-e", "vllm_tensor_parallel_size=3", rc=ExitCode.PLAN_ERRORS)  # an error path
    for text in shown:
        assert SECRET not in text
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(src)
               and p.name != "pw"]
    holding = sorted(str(p.relative_to(tmp_path)) for p in written if SECRET in p.read_text(errors="replace"))
    assert holding == ["out/h1/etc/ernie-deploy/ernie-vllm-0.env"], holding
    assert any(p.is_relative_to(tmp_path / "export") for p in written)
    for command in fake.received:
        assert SECRET not in command.script, command.op
    assert any(SECRET in content for path, content in fake.files.items() if path.endswith(".env"))


def test_the_export_keeps_vault_values_and_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(tmp_path / "pw"))
    inv = by_vault_value(tmp_path)
    assert main(["export", "ansible", *inv, "-o", str(tmp_path / "x")]) == ExitCode.OK
    exported = (tmp_path / "x" / "inventory.yml").read_text()
    assert "vllm_api_key: !vault |" in exported and "$ANSIBLE_VAULT;1.1;AES256" in exported
    (tmp_path / "key").write_text(SECRET)
    (tmp_path / "inv2.yml").write_text(HOST + f"      vllm_api_key_file: {tmp_path / 'key'}\n")
    assert main(["export", "ansible", "-i", str(tmp_path / "inv2.yml"), "-o", str(tmp_path / "y")]) == ExitCode.OK
    exported = (tmp_path / "y" / "inventory.yml").read_text()
    assert f"vllm_api_key: '{{{{ lookup(''ansible.builtin.file'', ''{tmp_path / 'key'}'') }}}}'" in exported
    assert SECRET not in exported and SECRET not in capsys.readouterr().out
