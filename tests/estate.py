"""One fleet written the ways an Ansible estate writes it: a YAML inventory with `!vault` values, an INI file, an
inventory directory, and an executable inventory script, the last three with their secrets in a group_vars/ file
encrypted whole by ansible-vault. Used to check that every form plans, renders and deploys the same.

The fleet comes as a YAML inventory's data (`all: children: GROUP: hosts/vars`, one level of groups) plus, per
group, the secret variables to encrypt.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from vaulthelp import encrypt

FORMS = ("yaml", "ini", "dir", "script")


class _Vault:
    def __init__(self, text: str) -> None:
        self.text = text


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Vault, lambda d, v: d.represent_scalar("!vault", v.text, style="|"))


def _groups(inventory: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = inventory["all"]["children"]
    return groups


def write_forms(root: Path, inventory: Mapping[str, Any], secrets: Mapping[str, Mapping[str, str]],
                password: str) -> dict[str, list[str]]:
    """Write every form under `root`; for each, the `-i` arguments (plus the vault password file) to read it."""
    root.mkdir(parents=True, exist_ok=True)
    password_file = root / "vault-password"
    password_file.write_text(password + "\n")
    vault = ["--vault-password-file", str(password_file)]
    plain = {"all": {**inventory["all"], "children": {g: dict(body) for g, body in _groups(inventory).items()}}}
    return {
        "yaml": ["-i", str(_yaml_form(root / "yaml", plain, secrets, password)), *vault],
        "ini": ["-i", str(_ini_form(root / "ini", plain, secrets, password)), *vault],
        "dir": ["-i", str(_dir_form(root / "dir", plain, secrets, password)), *vault],
        "script": ["-i", str(_script_form(root / "script", plain, secrets, password)), *vault],
    }


def _yaml_form(folder: Path, inventory: dict[str, Any], secrets: Mapping[str, Mapping[str, str]],
               password: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(inventory))
    for group, values in secrets.items():
        group_vars = _groups(data)[group].setdefault("vars", {})
        for var, value in values.items():
            group_vars[var] = _Vault(encrypt(value.encode(), password.encode()))
    path = folder / "inventory.yml"
    path.write_text(yaml.dump(data, Dumper=_Dumper, sort_keys=False))
    return path


def _secret_group_vars(folder: Path, secrets: Mapping[str, Mapping[str, str]], password: str) -> None:
    (folder / "group_vars").mkdir(parents=True, exist_ok=True)
    for group, values in secrets.items():
        text = yaml.safe_dump(dict(values), sort_keys=False)
        (folder / "group_vars" / f"{group}.yml").write_text(encrypt(text.encode(), password.encode()))


def _ini_value(value: Any) -> str:
    """A value as an INI line writes it: ansible-core's ini plugin literal-evaluates it (JSON for lists and
    mappings reads back the same)."""
    return value if isinstance(value, str) and " " not in value and "=" not in value else json.dumps(value)


def _ini_form(folder: Path, inventory: dict[str, Any], secrets: Mapping[str, Mapping[str, str]],
              password: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for group, body in _groups(inventory).items():
        lines.append(f"[{group}]")
        for host, host_vars in (body.get("hosts") or {}).items():
            words = " ".join(f"{k}={_ini_value(v)}" for k, v in (host_vars or {}).items())
            lines.append(f"{host} {words}".strip())
        if body.get("vars"):
            lines.append(f"[{group}:vars]")
            lines += [f"{k}={_ini_value(v)}" for k, v in body["vars"].items()]
        lines.append("")
    if inventory["all"].get("vars"):
        lines.append("[all:vars]")
        lines += [f"{k}={_ini_value(v)}" for k, v in inventory["all"]["vars"].items()]
    path = folder / "hosts.ini"
    path.write_text("\n".join(lines) + "\n")
    _secret_group_vars(folder, secrets, password)
    return path


def _dir_form(folder: Path, inventory: dict[str, Any], secrets: Mapping[str, Mapping[str, str]],
              password: str) -> Path:
    """An inventory directory: one YAML file per group, the shared variables in another, secrets in group_vars/."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (group, body) in enumerate(_groups(inventory).items()):
        (folder / f"{i + 10}-{group}.yml").write_text(yaml.safe_dump({group: body}, sort_keys=False))
    if inventory["all"].get("vars"):
        (folder / "00-all.yml").write_text(yaml.safe_dump({"all": {"vars": inventory["all"]["vars"]}}))
    (folder / "README.md").write_text("ansible-core skips .md files in an inventory directory\n")
    _secret_group_vars(folder, secrets, password)
    return folder


def _script_form(folder: Path, inventory: dict[str, Any], secrets: Mapping[str, Mapping[str, str]],
                 password: str) -> Path:
    """An executable inventory script answering --list with the whole inventory (host variables in _meta)."""
    folder.mkdir(parents=True, exist_ok=True)
    listing: dict[str, Any] = {"_meta": {"hostvars": {}}, "all": {"children": list(_groups(inventory))}}
    if inventory["all"].get("vars"):
        listing["all"]["vars"] = inventory["all"]["vars"]
    for group, body in _groups(inventory).items():
        listing[group] = {"hosts": list(body.get("hosts") or {}), "vars": body.get("vars") or {}}
        for host, host_vars in (body.get("hosts") or {}).items():
            listing["_meta"]["hostvars"][host] = host_vars or {}
    path = folder / "inventory.py"
    path.write_text(f"#!{sys.executable}\nimport json, sys\nDATA = {json.dumps(listing)!r}\n"
                    "if sys.argv[1:] == ['--list']:\n    print(DATA)\nelse:\n    print('{}')\n")
    os.chmod(path, 0o755)
    _secret_group_vars(folder, secrets, password)
    return path
