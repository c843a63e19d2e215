"""`export ansible`: the validated plan as a self-contained Ansible project (docs/ansible.md).

What lands is what was validated: each host's units are the rendered files, verbatim; env files become
templates whose only variables are the secrets; the inventory is the user's with every secret value
replaced by a reference to a vault variable. The role (content/roles/ernie_vllm) uses ansible.builtin only,
and keeps ernie-deploy's record on the host through one stdlib program (hostscript.py). Pure: files in,
files out; the CLI writes them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.errors import InventoryError
from ernie_deploy.export.program import host_program
from ernie_deploy.planning.batches import SerialItem
from ernie_deploy.planning.hostpaths import ENV_DIR, UNIT_DIR, local_url
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import RenderedFile
from ernie_deploy.planning.settings import SECRET_VARS, SETTING_TYPES, Secret

ROLE = "roles/ernie_vllm"
GROUP = "ernie_export"  # the hosts of the export, added to the inventory: the plays run on exactly these
MARKER = ".ernie-export"  # names a directory as an export, so a re-export may replace it
# Inventory variables holding secrets: the vllm_* settings marked secret, and hf_token.
SECRET_KEYS = frozenset({f"vllm_{name}" for name, t in SETTING_TYPES.items() if t.secret} | set(SECRET_VARS))
# The env file's variable → the inventory variable its value comes from.
ENV_SECRET_VAR = {"VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "hf_token"}
_SENTINEL = "@@ernie-export-secret-{}@@"
_JINJA = re.compile(r"{[{%#]|[}%#]}")


@dataclass(frozen=True)
class ExportOptions:
    serial: Sequence[SerialItem] = (1,)
    canary: int = 0
    max_fail_percentage: float | None = None
    pre_drain: str = ""
    post_ready: str = ""


@dataclass(frozen=True)
class ExportFile:
    path: str  # relative to the export directory
    content: str
    mode: int = 0o644


def env_template(text: str, plan: HostPlan) -> str:
    """A rendered env file (with sentinels for secret values) as a Jinja template for Ansible's `template`:
    literal text stays literal, each sentinel becomes its inventory variable."""
    if _JINJA.search(text):
        text = "{% raw %}" + text + "{% endraw %}"
        close, reopen = "{% endraw %}", "{% raw %}"
    else:
        close = reopen = ""
    for env_name in plan.secrets:
        var = ENV_SECRET_VAR.get(env_name)
        if var is None:
            raise InventoryError(f"secret {env_name} has no inventory variable to export", where=plan.name)
        text = text.replace(_SENTINEL.format(env_name), f"{close}{{{{ {var} }}}}{reopen}")
    return text


def host_files(plan: HostPlan, render: Callable[[HostPlan], list[RenderedFile]]) -> list[RenderedFile]:
    """The host's files rendered with sentinels in place of secret values: no secret reaches the export."""
    masked = dataclasses.replace(plan, secrets={k: Secret(_SENTINEL.format(k)) for k in plan.secrets})
    return render(masked)


def host_vars(plan: HostPlan) -> dict[str, Any]:
    return {
        "ernie_vllm_units": [i.unit for i in plan.instances],
        "ernie_vllm_instances": [{
            "unit": i.unit, "index": i.index, "port": i.port, "url": local_url(i.host, i.port),
            "gpus": ",".join(str(g) for g in i.gpus),
            "tensor_parallel_size": i.tensor_parallel_size, "max_model_len": i.max_model_len,
            "served_model_name": i.served_model_name,
        } for i in plan.instances],
        # Instances sharing GPUs keep each other's processes on them: no "GPUs free" wait there.
        "ernie_vllm_gpu_wait": not plan.tuning.share_gpus,
        "ernie_vllm_keep_releases": plan.tuning.keep_releases,
        "ernie_vllm_startup_budget": plan.tuning.startup_budget,
        "ernie_vllm_stable_seconds": plan.tuning.stable_seconds,
        "ernie_vllm_secret_vars": sorted(ENV_SECRET_VAR[k] for k in plan.secrets),
        "ernie_vllm_api_key_var": "vllm_api_key" if "VLLM_API_KEY" in plan.secrets else "",
    }


class _Vault:
    """Secret values → vault variable names: one name per distinct value, so no value is written anywhere."""

    def __init__(self) -> None:
        self.names: dict[tuple[str, str], str] = {}

    def ref(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            value = str(value)
        if (key, value) not in self.names:
            count = sum(1 for k, _ in self.names if k == key)
            self.names[(key, value)] = f"vault_{key}" if count == 0 else f"vault_{key}_{count + 1}"
        return "{{ " + self.names[(key, value)] + " }}"


def redact(data: Any, vault: _Vault, base: Path) -> Any:
    """A copy of inventory data with secret values replaced by vault references, and ernie-deploy's
    `ernie_known_hosts` carried over as `ansible_ssh_common_args` (strict host keys against that file)."""
    if isinstance(data, list):
        return [redact(v, vault, base) for v in data]
    if not isinstance(data, dict):
        return data
    out = {k: (vault.ref(k, v) if k in SECRET_KEYS and v is not None else redact(v, vault, base))
           for k, v in data.items()}
    known = data.get("ernie_known_hosts")
    if isinstance(known, str) and known:
        path = Path(known).expanduser()
        path = path if path.is_absolute() else base / path
        option = f"-o UserKnownHostsFile={path}"
        args = str(out.get("ansible_ssh_common_args") or "")
        if option not in args:
            out["ansible_ssh_common_args"] = f"{args} {option}".strip()
    return out


class _Dumper(yaml.SafeDumper):
    """Lists indented under their key, as ansible-lint's yamllint rules want."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _yaml(data: Any, header: str = "") -> str:
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def inventory_files(path: Path, hosts: Sequence[str], vault: _Vault) -> list[ExportFile]:
    """The user's inventory (and group_vars/, host_vars/ beside it), secrets replaced, plus the export group."""
    base = path.resolve().parent
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise InventoryError("the inventory is not a YAML mapping", where=str(path))
    redacted = redact(data, vault, base)
    redacted[GROUP] = {"hosts": dict.fromkeys(hosts, None)}
    header = (f"# The inventory {path.name} as exported by ernie-deploy: every secret value is a reference to a\n"
              f"# vault variable (vault.example.yml); group {GROUP} holds the hosts of the export.\n")
    files = [ExportFile("inventory.yml", _yaml(redacted, header))]
    for kind in ("group_vars", "host_vars"):
        folder = base / kind
        if not folder.is_dir():
            continue
        for item in sorted(folder.rglob("*")):
            if item.is_file() and item.suffix in (".yml", ".yaml", ""):
                content = yaml.safe_load(item.read_text(encoding="utf-8"))
                files.append(ExportFile(f"{kind}/{item.relative_to(folder)}", _yaml(redact(content, vault, base))))
    return files


def _serial(options: ExportOptions) -> list[SerialItem]:
    items = list(options.serial) or [0]
    return ([options.canary] if options.canary else []) + items


def _play(name: str, options: ExportOptions, action: str, restart_all: bool, command: str) -> str:
    play: dict[str, Any] = {"name": name[:1].upper() + name[1:], "hosts": GROUP, "gather_facts": False}
    if action != "verify":
        play["serial"] = _serial(options)
        if options.max_fail_percentage is not None:
            mfp = options.max_fail_percentage
            play["max_fail_percentage"] = int(mfp) if mfp == int(mfp) else mfp
    play["pre_tasks"] = [{
        "name": "Who runs this (the deploy lock and the audit log name it)",
        "ansible.builtin.set_fact": {
            "ernie_vllm_lock_token": "{{ lookup('ansible.builtin.password', '/dev/null', chars=['hexdigits'], "
                                "length=32) }}",
            "ernie_vllm_user": "{{ lookup('ansible.builtin.env', 'USER') | default('ansible', true) }}",
            "ernie_vllm_controller": "{{ lookup('ansible.builtin.pipe', 'hostname 2>/dev/null || uname -n') }}",
            # The ansible-playbook process (the parent of the worker that runs the lookup's shell).
            "ernie_vllm_pid": "{{ lookup('ansible.builtin.pipe', 'ps -o ppid= -p $PPID 2>/dev/null || echo 0') "
                              "| trim }}",
            "ernie_vllm_command": command,
        },
        "check_mode": False,
    }] if action != "verify" else []
    role_vars: dict[str, Any] = {"ernie_vllm_action": action, "ernie_vllm_restart_all": restart_all}
    if action != "verify":
        role_vars.update({k: v for k, v in (("ernie_vllm_pre_drain", options.pre_drain),
                                            ("ernie_vllm_post_ready", options.post_ready)) if v})
    play["roles"] = [{"role": "ernie_vllm", "vars": role_vars}]
    return _yaml([play])


PLAYBOOKS = {
    "site.yml": ("converge", False, "Deploy: copy the units and env files, record the release, and restart (or "
                 "start) only the\n# instances whose files changed, host batch by host batch; each one is "
                 "drained, stopped,\n# started, waited for and verified. A second run changes nothing."),
    "rolling-restart.yml": ("converge", True, "Rolling restart: every instance of every host, batch by batch "
                            "(the first batch is the\n# canary when --canary was given), files converged first; "
                            "a failed instance gets the\n# release it ran back and stops the play after its batch."),
    "verify.yml": ("verify", False, "Verify every instance without changing anything: /health, /v1/models, a "
                   "smoke completion,\n# and its start-up log (the tensor parallel size in use, no fatal line)."),
}


def playbook_files(options: ExportOptions) -> list[ExportFile]:
    out = []
    for name, (action, restart_all, about) in PLAYBOOKS.items():
        header = f"---\n# {name}, written by ernie-deploy export ansible.\n# {about}\n"
        body = _play(name.removesuffix(".yml").replace("-", " "), options, action, restart_all,
                     f"ansible-playbook {name}")
        out.append(ExportFile(name, header + body))
    return out


def _content(rel: str) -> str:
    return (resources.files("ernie_deploy.export") / "content" / rel).read_text(encoding="utf-8")


STATIC = ("roles/ernie_vllm/defaults/main.yml", "roles/ernie_vllm/handlers/main.yml",
          "roles/ernie_vllm/tasks/main.yml", "roles/ernie_vllm/tasks/converge.yml",
          "roles/ernie_vllm/tasks/cycle.yml", "roles/ernie_vllm/tasks/verify_instance.yml",
          "ansible.cfg", "README.md")


def export_files(inventory: Path, plans: Sequence[HostPlan], rendered: Mapping[str, list[RenderedFile]],
                 options: ExportOptions) -> list[ExportFile]:
    """Every file of the export. `rendered` maps each host to its files rendered with host_files (masked)."""
    vault = _Vault()
    files = [ExportFile(rel, _content(rel)) for rel in STATIC]
    files.append(ExportFile(f"{ROLE}/files/ernie_host.py", host_program(), 0o755))
    for plan in plans:
        for f in rendered[plan.name]:
            name = f.path.rsplit("/", 1)[1]
            if f.path.startswith(UNIT_DIR + "/"):
                files.append(ExportFile(f"{ROLE}/files/hosts/{plan.name}/{name}", f.content))
            elif f.path.startswith(ENV_DIR + "/"):
                files.append(ExportFile(f"{ROLE}/templates/hosts/{plan.name}/{name}.j2", env_template(f.content, plan),
                                        0o600))
        files.append(ExportFile(f"{ROLE}/vars/hosts/{plan.name}.yml",
                                _yaml(host_vars(plan), f"---\n# {plan.name}'s plan, from ernie-deploy export.\n")))
    files += inventory_files(inventory, [p.name for p in plans], vault)
    files += playbook_files(options)
    names = sorted(set(vault.names.values()))
    example = ("# The vault variables the inventory refers to. Put the real values in an encrypted file:\n"
               "#   ansible-vault create vault.yml     (then: ansible-playbook site.yml -e @vault.yml "
               "--ask-vault-pass)\n# or inject them as extra variables from an AWX credential (docs/ansible.md).\n")
    files.append(ExportFile("vault.example.yml", example + "".join(f"{n}: CHANGE_ME\n" for n in names)))
    files.append(ExportFile(MARKER, "written by ernie-deploy export ansible; a re-export replaces this directory\n"))
    return files
