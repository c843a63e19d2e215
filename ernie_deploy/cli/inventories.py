"""The inventory options every command shares, and reading the inventory the way the operator's Ansible does.

`-i` is repeatable and takes what `ansible-inventory` takes. YAML files and directories of them are read by the
bundled reader (ernie_deploy/inventory/), which needs no ansible-core and costs no extra process; any other
source (INI, an executable script, an inventory plugin's configuration, `host1,host2,`) and any mix with one is
read by running ansible-core's `ansible-inventory --list`, a separate program, so its license stays out of this
package. ERNIE_INVENTORY_READER=ansible sends YAML through it too (an ansible.cfg with a non-default
hash_behaviour, vars plugins of its own), =bundled never runs it. Vault passwords are read once, here; the
values are resolved where they are used (inventory/resolve.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ernie_deploy.errors import InventoryError

if TYPE_CHECKING:
    from ernie_deploy.inventory.inventory import Inventory
    from ernie_deploy.inventory.vault import VaultSecret

READER_ENV = "ERNIE_INVENTORY_READER"
# A dynamic source (a cloud plugin, a script asking NetBox) may be slow, never endless.
ANSIBLE_INVENTORY_TIMEOUT_S = 300


@dataclass(frozen=True)
class Sources:
    """The `-i` sources as given, in order."""

    given: tuple[str, ...]

    @property
    def shown(self) -> str:
        return ", ".join(self.given)

    @property
    def base_dir(self) -> Path:
        """The directory relative paths in the inventory start from: the first source's (a directory source is
        its own)."""
        first = Path(self.given[0])
        return (first if first.is_dir() else first.absolute().parent).resolve()

    def key(self) -> str:
        """The sources as one string, stable across working directories (resume state is keyed by it)."""
        resolved = [str(Path(g).resolve()) if Path(g).exists() else g for g in self.given]
        return resolved[0] if len(resolved) == 1 else json.dumps(resolved)


class _AppendSource(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        given = before.given if isinstance(before, Sources) else ()
        setattr(namespace, self.dest, Sources((*given, str(values))))


def add_inventory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--inventory", required=True, action=_AppendSource, metavar="INV",
                   help="inventory source, as ansible-inventory takes it: a YAML or INI file, a directory (with "
                        "group_vars/ and host_vars/), an executable script, an inventory plugin's configuration; "
                        "repeat to merge several, later ones winning (non-YAML sources need ansible-core)")
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                   help="variables that win over the inventory's, as in Ansible: key=value ..., a YAML/JSON "
                        "mapping, or @FILE; repeatable")
    p.add_argument("--vault-password-file", "--vault-pass-file", action="append", default=[], metavar="FILE",
                   help="ansible-vault password: a file, or an executable that prints it")
    p.add_argument("--vault-id", action="append", default=[], metavar="[LABEL@]SOURCE",
                   help="ansible-vault identity: a password file, an executable, or `prompt`")
    p.add_argument("-J", "--ask-vault-pass", "--ask-vault-password", action="store_true",
                   help="ask for the ansible-vault password")


def load(args: argparse.Namespace) -> Inventory:
    """The inventory with extra variables applied and values resolving on use (vault, templates)."""
    from ernie_deploy.cli.extravars import parse_extra_vars
    from ernie_deploy.inventory.resolve import Resolution, resolve_inventory
    from ernie_deploy.planning.settings import SECRET_FILE_VARS
    sources: Sources = args.inventory
    decrypt = _decrypter(args)
    inventory = _read_once(args, decrypt)
    extra = parse_extra_vars(args.extra_vars, decrypt)
    return resolve_inventory(inventory, Resolution(environ=dict(os.environ), base_dir=sources.base_dir,
                                                   decrypt=decrypt, extra_vars=extra, file_vars=SECRET_FILE_VARS))


def load_raw(args: argparse.Namespace) -> Inventory:
    """The inventory as ansible-inventory shows it: extra variables on top, nothing decrypted or templated."""
    from ernie_deploy.cli.extravars import parse_extra_vars
    from ernie_deploy.inventory.inventory import Host
    decrypt = _decrypter(args)
    inventory = _read_once(args, decrypt)
    extra = parse_extra_vars(args.extra_vars, decrypt)
    if not extra:
        return inventory
    return inventory.replace_hosts({n: Host(n, {**h.vars, **extra}, h.groups) for n, h in inventory.hosts.items()})


def _read_once(args: argparse.Namespace, decrypt: _Vault | None) -> Inventory:
    """The inventory as read, once per command: export reads it resolved and raw, and a second read would run
    ansible-inventory (or parse every file) again. Resolving copies it, so the one read serves both."""
    if not hasattr(args, "inventory_read"):
        args.inventory_read = _read(args.inventory, decrypt)
    inventory: Inventory = args.inventory_read
    return inventory


def _read(sources: Sources, decrypt: _Vault | None) -> Inventory:
    from ernie_deploy.inventory.inventory import INSTALL_ANSIBLE, load_sources
    from ernie_deploy.inventory.sources import classify
    reader = os.environ.get(READER_ENV, "auto")
    if reader not in ("auto", "ansible", "bundled"):
        raise InventoryError(f"{READER_ENV}={reader!r} is not a reader", where=READER_ENV,
                             hint="use auto (the default), ansible or bundled")
    classified = [classify(g) for g in sources.given]
    if reader == "bundled":
        return load_sources(classified, decrypt)
    foreign = [s for s in classified if s.foreign and s.foreign != "missing"]
    if reader == "auto" and not foreign:
        return load_sources(classified, decrypt)
    tool = ansible_inventory()
    if tool is None:
        if foreign:
            raise InventoryError(f"{foreign[0].foreign} needs ansible-inventory, which is not installed",
                                 where=foreign[0].foreign_path, hint=INSTALL_ANSIBLE)
        raise InventoryError(f"{READER_ENV}=ansible, but ansible-inventory is not installed", where=READER_ENV,
                             hint=INSTALL_ANSIBLE)
    return _through_ansible(tool, sources, decrypt.secrets if decrypt is not None else ())


def ansible_inventory() -> str | None:
    """ansible-inventory on PATH, or beside this Python (ernie-deploy installed in a venv that is not active)."""
    found = shutil.which("ansible-inventory")
    if found:
        return found
    beside = Path(sys.executable).parent / "ansible-inventory"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def _through_ansible(tool: str, sources: Sources, secrets: Sequence[VaultSecret]) -> Inventory:
    from ernie_deploy.inventory.ansiblelist import from_ansible_list
    for given in sources.given:
        if "," not in given and not Path(given).exists():
            raise InventoryError("inventory source not found", where=given,
                                 hint="pass an inventory file, directory, script or plugin configuration")
    env = dict(os.environ)
    # ansible-inventory only warns about a source it cannot parse and goes on without its hosts: here that is
    # an error, so nothing is half-read.
    env.setdefault("ANSIBLE_INVENTORY_UNPARSED_FAILED", "true")
    env.setdefault("ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED", "true")
    env.setdefault("ANSIBLE_NOCOLOR", "1")
    command = [tool, *(a for g in sources.given for a in ("-i", g)), "--list"]
    with tempfile.TemporaryDirectory(prefix="ernie-vault-") as private:
        command += _vault_ids(Path(private), secrets, env)
        try:
            proc = subprocess.run(command, capture_output=True, env=env, timeout=ANSIBLE_INVENTORY_TIMEOUT_S,
                                  check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise InventoryError(f"ansible-inventory did not answer within {ANSIBLE_INVENTORY_TIMEOUT_S} s",
                                 where=sources.shown, hint="check that the dynamic sources can reach their "
                                 "service; run `ansible-inventory -i SOURCE --list` to see where it waits") from None
        except OSError as exc:
            raise InventoryError(f"cannot run ansible-inventory: {exc.strerror or exc}", where=tool,
                                 hint="reinstall ansible-core") from None
    if proc.returncode != 0:
        raise InventoryError(f"ansible-inventory failed: {_ansible_error(proc.stderr)}", where=sources.shown,
                             hint="fix the source it names; `ansible-inventory -i SOURCE --list` shows the same")
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        raise InventoryError("ansible-inventory printed no JSON", where=sources.shown,
                             hint="run `ansible-inventory -i SOURCE --list` to see what it prints") from None
    return from_ansible_list(data, sources.shown)


def _vault_ids(private: Path, secrets: Sequence[VaultSecret], env: dict[str, str]) -> list[str]:
    """Hand ansible-inventory the passwords already read (so nothing is prompted for twice) without putting them
    on a command line or on disk: a script in a private directory prints each from the environment, which
    only the same user can read."""
    args: list[str] = []
    for i, secret in enumerate(secrets):
        script = private / f"password-{i}"
        script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$ERNIE_VAULT_PASSWORD_{i}"\n', encoding="utf-8")
        script.chmod(0o700)
        env[f"ERNIE_VAULT_PASSWORD_{i}"] = os.fsdecode(secret.password)
        args += ["--vault-id", f"{secret.label}@{script}"]
    return args


def _ansible_error(stderr: bytes) -> str:
    """ansible-inventory's own error: its [ERROR] text, then why each plugin gave up on the source (it tells those
    as warnings, and a script's standard error only there), without its other warnings."""
    lines = [line.rstrip() for line in stderr.decode(errors="replace").splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("[ERROR]")), None)
    error = " ".join(ln.strip() for ln in lines[start:] if ln.strip()) if start is not None else ""
    causes: list[str] = []
    for i, line in enumerate(lines):
        failed = _PLUGIN_FAILED.match(line)
        if failed:
            causes.append(f"{failed.group(1)} plugin: {failed.group(2)}")
        if line.startswith("Standard error from inventory script:") and i + 1 < len(lines):
            causes.append(f"the script's standard error: {lines[i + 1].strip()}")
    text = "; ".join([error.removeprefix("[ERROR]: ") or "no message", *causes])
    return text[:2000]


_PLUGIN_FAILED = re.compile(r"\[WARNING\]: Failed to parse inventory with '([^']+)' plugin: (.*)")


class _Vault:
    """The vault passwords of this run, as the decrypt callback inventory reading takes."""

    def __init__(self, secrets: Sequence[VaultSecret]) -> None:
        self.secrets = tuple(secrets)

    def __call__(self, text: str, what: str, where: str) -> str:
        from ernie_deploy.inventory.vault import decrypt
        return decrypt(text, self.secrets, where=where, what=what)


def _decrypter(args: argparse.Namespace) -> _Vault | None:
    """The run's vault passwords, read once however often the inventory is (export reads it twice): a prompt
    asks once."""
    if not hasattr(args, "vault_read"):
        from ernie_deploy.cli.vaultpass import vault_secrets
        secrets = vault_secrets(args.vault_password_file, args.vault_id, args.ask_vault_pass, os.environ)
        args.vault_read = _Vault(secrets) if secrets else None
    vault: _Vault | None = args.vault_read
    return vault
