"""`export ansible`: the validated plan as a self-contained Ansible project (docs/ansible.md).

What lands is what was validated: each host's units are the rendered files, verbatim; env files become
templates whose only variables are the secrets; the inventory is the user's with every secret value
replaced by a reference to a vault variable. The role (content/roles/ernie_vllm) uses ansible.builtin only,
and keeps ernie-deploy's record on the host through one stdlib program (hostscript.py). Pure: files in,
files out; the CLI writes them.

With balancers in the inventory (group vllm_balancers, planning/balancer.py), a second role
(content/roles/ernie_balancer) installs each one's rendered HAProxy configuration, and the rolling cycle drains
every instance through each fronting balancer's runtime API before it stops and sets it ready once it verified.
The balancer tasks of the shared content sit between `# >>> balancers` and `# <<< balancers` lines: an export
without balancers drops them, so it stays what it was before balancers existed, byte for byte.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.errors import InventoryError
from ernie_deploy.export.program import host_program, regions
from ernie_deploy.inventory.inventory import Inventory
from ernie_deploy.inventory.resolve import is_template
from ernie_deploy.inventory.vault import is_vaulted
from ernie_deploy.inventory.yamlfile import Unsafe, Vaulted, load_yaml, plain
from ernie_deploy.planning.balancer import BalancerPlan, unit_dropin
from ernie_deploy.planning.batches import SerialItem
from ernie_deploy.planning.hostpaths import ENV_DIR, UNIT_DIR, local_url
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import RenderedFile
from ernie_deploy.planning.settings import SECRET_FILE_VARS, SECRET_INVENTORY_VARS, Secret

ROLE = "roles/ernie_vllm"
BALANCER_ROLE = "roles/ernie_balancer"
GROUP = "ernie_export"  # the hosts of the export, added to the inventory: the plays run on exactly these
BALANCER_GROUP = "ernie_balancers"  # the balancer hosts of the export (group vllm_balancers, as --limit kept them)
# HAProxy's default-server `rise`: checks a server passes before it is UP (templates/haproxy.cfg.j2).
RISE = 2
SECRET_KEYS = SECRET_INVENTORY_VARS
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


def _template(text: str, variables: Mapping[str, str]) -> str:
    """Rendered text holding sentinels as a Jinja template for Ansible's `template`: literal text stays literal,
    each sentinel (a key of `variables`) becomes its variable."""
    if _JINJA.search(text):
        text = "{% raw %}" + text + "{% endraw %}"
        close, reopen = "{% endraw %}", "{% raw %}"
    else:
        close = reopen = ""
    for sentinel, var in variables.items():
        text = text.replace(sentinel, f"{close}{{{{ {var} }}}}{reopen}")
    return text


def env_template(text: str, plan: HostPlan) -> str:
    """A rendered env file (with sentinels for secret values) as a template whose variables are the secrets'
    inventory variables."""
    variables = {}
    for env_name in plan.secrets:
        var = ENV_SECRET_VAR.get(env_name)
        if var is None:
            raise InventoryError(f"secret {env_name} has no inventory variable to export", where=plan.name)
        variables[_SENTINEL.format(env_name)] = var
    return _template(text, variables)


def masked_balancer(plan: BalancerPlan) -> BalancerPlan:
    """The balancer's plan with a sentinel in place of each backend's API key, for rendering into the export."""
    backends = tuple(dataclasses.replace(b, api_key=Secret(_SENTINEL.format(f"balancer-{i}")))
                     if b.api_key is not None else b for i, b in enumerate(plan.backends))
    return dataclasses.replace(plan, backends=backends)


def balancer_template(text: str, plan: BalancerPlan, vault: _Vault) -> tuple[str, list[str]]:
    """A configuration rendered from masked_balancer(plan) as a template whose only variables are the vault
    variables of the backends' API keys (the names the inventory's vllm_api_key values got); and those names."""
    variables = {}
    for i, backend in enumerate(plan.backends):
        if backend.api_key is not None:
            variables[_SENTINEL.format(f"balancer-{i}")] = vault.name("vllm_api_key", backend.api_key.reveal())
    return _template(text, variables), sorted(set(variables.values()))


def balancer_dropin(plan: BalancerPlan) -> str:
    """HAProxy's unit drop-in for the balancer ("" for none): the text `ernie-deploy deploy` writes."""
    return unit_dropin(plan.config_path, posixpath.dirname(plan.admin_socket)) or ""


def balancer_vars(plan: BalancerPlan, secret_vars: Sequence[str]) -> dict[str, Any]:
    return {"ernie_balancer_config": plan.config_path, "ernie_balancer_admin_socket": plan.admin_socket,
            "ernie_balancer_dropin": balancer_dropin(plan).splitlines(),
            "ernie_balancer_secret_vars": list(secret_vars)}


def fronting(plan: HostPlan, balancers: Sequence[BalancerPlan]) -> dict[int, list[dict[str, Any]]]:
    """Instance index → the balancers that front it: where to reach each one's runtime API, the names HAProxy
    knows the instance by, and how many 1 s polls to give it to come UP (rise checks, twice, and 5 s)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for instance in plan.instances:
        for balancer in balancers:
            found = balancer.server_for(plan.name, instance.index)
            if found is not None:
                backend, server = found
                out.setdefault(instance.index, []).append({
                    "host": balancer.host, "socket": balancer.admin_socket, "backend": backend.name,
                    "server": server.name, "up_retries": math.ceil(2 * RISE * balancer.check_interval + 5)})
    return out




def host_files(plan: HostPlan, render: Callable[[HostPlan], list[RenderedFile]]) -> list[RenderedFile]:
    """The host's files rendered with sentinels in place of secret values: no secret reaches the export."""
    masked = dataclasses.replace(plan, secrets={k: Secret(_SENTINEL.format(k)) for k in plan.secrets})
    return render(masked)


def host_vars(plan: HostPlan, balancers: Mapping[int, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """The host's plan for the role; `balancers` (from fronting) adds each instance's balancers."""
    return {
        "ernie_vllm_units": [i.unit for i in plan.instances],
        "ernie_vllm_instances": [{
            "unit": i.unit, "index": i.index, "port": i.port, "url": local_url(i.host, i.port),
            "gpus": ",".join(str(g) for g in i.gpus),
            "tensor_parallel_size": i.tensor_parallel_size, "max_model_len": i.max_model_len,
            "served_model_name": i.served_model_name,
            **({"balancers": balancers.get(i.index, [])} if balancers is not None else {}),
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

    def name(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            value = str(value)
        if (key, value) not in self.names:
            count = sum(1 for k, _ in self.names if k == key)
            self.names[(key, value)] = f"vault_{key}" if count == 0 else f"vault_{key}_{count + 1}"
        return self.names[(key, value)]

    def ref(self, key: str, value: Any) -> str:
        return "{{ " + self.name(key, value) + " }}"


def redact(data: Any, vault: _Vault, base: Path) -> Any:
    """A copy of inventory data with secret values replaced by vault references, and ernie-deploy's
    `ernie_known_hosts` carried over as `ansible_ssh_common_args` (strict host keys against that file).

    A secret that is already safe to write stays as it is: a `!vault` value (ansible-playbook decrypts it with
    the same password) or a template (a lookup Ansible evaluates on its controller). A secret given as a file
    on the controller (vllm_api_key_file) becomes a file lookup of that path."""
    if isinstance(data, list):
        return [redact(v, vault, base) for v in data]
    if not isinstance(data, dict):
        return data
    out: dict[Any, Any] = {}
    for k, v in data.items():
        if k in SECRET_FILE_VARS and isinstance(v, str) and not is_template(v):
            path = Path(v).expanduser()
            out[SECRET_FILE_VARS[k]] = "{{ lookup('ansible.builtin.file', " + repr(str(
                path if path.is_absolute() else base / path)) + ") }}"
        elif k in SECRET_KEYS and v is not None and not _safe_secret(v):
            out[k] = vault.ref(k, v)
        else:
            out[k] = redact(v, vault, base)
    known = data.get("ernie_known_hosts")
    if isinstance(known, str) and known:
        path = Path(known).expanduser()
        path = path if path.is_absolute() else base / path
        option = f"-o UserKnownHostsFile={path}"
        args = str(out.get("ansible_ssh_common_args") or "")
        if option not in args:
            out["ansible_ssh_common_args"] = f"{args} {option}".strip()
    return out


def _safe_secret(value: Any) -> bool:
    return isinstance(value, Vaulted) or is_template(value)


class _Dumper(yaml.SafeDumper):
    """Lists indented under their key, as ansible-lint's yamllint rules want."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


_Dumper.add_representer(Vaulted, lambda d, v: d.represent_scalar("!vault", v.text, style="|"))
_Dumper.add_representer(Unsafe, lambda d, v: d.represent_scalar("!unsafe", str(v)))


def _yaml(data: Any, header: str = "") -> str:
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def inventory_files(source: Path | Inventory, hosts: Sequence[str], vault: _Vault,
                    balancers: Sequence[str] = ()) -> list[ExportFile]:
    """The user's inventory, secrets replaced, plus the export's groups. A YAML inventory file is kept as written
    (with the group_vars/ and host_vars/ beside it; a file encrypted whole by ansible-vault is copied as it is);
    any other source (INI, a directory, a script, a plugin, several -i) is written as one YAML inventory of the
    groups and each host's variables as ansible-inventory gave them."""
    if isinstance(source, Inventory):
        return _inventory_of(source, hosts, vault, balancers)
    path = source
    base = path.resolve().parent
    data = plain(load_yaml(path, str(path))) or {}
    if not isinstance(data, dict):
        raise InventoryError("the inventory is not a YAML mapping", where=str(path))
    redacted = redact(data, vault, base)
    files = [_with_groups(redacted, f"The inventory {path.name}", hosts, balancers)]
    for kind in ("group_vars", "host_vars"):
        folder = base / kind
        if not folder.is_dir():
            continue
        for item in sorted(folder.rglob("*")):
            if item.is_file() and item.suffix in (".yml", ".yaml", ""):
                text = item.read_text(encoding="utf-8")
                files.append(ExportFile(f"{kind}/{item.relative_to(folder)}", text if is_vaulted(text) else
                                        _yaml(redact(plain(load_yaml(item, str(item))), vault, base))))
    return files


def _inventory_of(inventory: Inventory, hosts: Sequence[str], vault: _Vault,
                  balancers: Sequence[str]) -> list[ExportFile]:
    tree = inventory.ansible_tree()
    base = Path(inventory.shown.split(", ")[0]).resolve()
    base = base if base.is_dir() else base.parent
    for name, host in inventory.hosts.items():
        for group in tree.values():
            if name in group.get("hosts", {}):
                group["hosts"][name] = redact(dict(host.vars), vault, base) or None
                break
    return [_with_groups(tree, f"The inventory {inventory.shown}", hosts, balancers)]


def _with_groups(data: dict[str, Any], title: str, hosts: Sequence[str], balancers: Sequence[str]) -> ExportFile:
    data[GROUP] = {"hosts": dict.fromkeys(hosts, None)}
    if balancers:
        data[BALANCER_GROUP] = {"hosts": dict.fromkeys(balancers, None)}
    header = (f"# {title} as exported by ernie-deploy: every secret value is a reference to a\n"
              f"# vault variable (vault.example.yml); group {GROUP} holds the hosts of the export.\n")
    return ExportFile("inventory.yml", _yaml(data, header))


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


def _balancer_play() -> dict[str, Any]:
    return {"name": "Balancers: HAProxy installed, its configuration as ernie-deploy rendered it, reloaded when it "
                    "changed", "hosts": BALANCER_GROUP, "gather_facts": False, "roles": [{"role": "ernie_balancer"}]}


def playbook_files(options: ExportOptions, balancers: bool = False) -> list[ExportFile]:
    """The playbooks; with `balancers`, site.yml and rolling-restart.yml converge the balancers first, so every
    instance a cycle drains is a server their configuration knows."""
    out = []
    for name, (action, restart_all, about) in PLAYBOOKS.items():
        header = f"---\n# {name}, written by ernie-deploy export ansible.\n# {about}\n"
        body = _play(name.removesuffix(".yml").replace("-", " "), options, action, restart_all,
                     f"ansible-playbook {name}")
        if balancers and action != "verify":
            header += ("# The balancers (group ernie_balancers) come first; each instance's cycle drains it through "
                       "every\n# balancer fronting it before it stops and sets it ready once it verified.\n")
            body = _yaml([_balancer_play()]) + body
        out.append(ExportFile(name, header + body))
    return out


def balancer_files(balancers: Sequence[BalancerPlan], configs: Mapping[str, str], vault: _Vault) -> list[ExportFile]:
    """The balancer role: its static content, and per balancer host its configuration template and its vars."""
    if not balancers:
        return []
    files = [ExportFile(rel, _content(rel)) for rel in BALANCER_STATIC]
    for plan in balancers:
        if plan.host not in configs:
            raise InventoryError("no rendered configuration for balancer", where=plan.host)
        template, secret_vars = balancer_template(configs[plan.host], plan, vault)
        # 0600 like the env templates: with an API key its text names the vault variable, not the value.
        files.append(ExportFile(f"{BALANCER_ROLE}/templates/hosts/{plan.host}/haproxy.cfg.j2", template, 0o600))
        files.append(ExportFile(f"{BALANCER_ROLE}/vars/hosts/{plan.host}.yml", _yaml(
            balancer_vars(plan, secret_vars), f"---\n# {plan.host}'s balancer plan, from ernie-deploy export.\n")))
    return files


def _content(rel: str) -> str:
    return (resources.files("ernie_deploy.export") / "content" / rel).read_text(encoding="utf-8")


STATIC = ("roles/ernie_vllm/defaults/main.yml", "roles/ernie_vllm/handlers/main.yml",
          "roles/ernie_vllm/tasks/main.yml", "roles/ernie_vllm/tasks/converge.yml",
          "roles/ernie_vllm/tasks/cycle.yml", "roles/ernie_vllm/tasks/verify_instance.yml",
          "ansible.cfg", "README.md")
BALANCER_STATIC = ("roles/ernie_balancer/defaults/main.yml", "roles/ernie_balancer/handlers/main.yml",
                   "roles/ernie_balancer/tasks/main.yml")


def export_files(inventory: Path | Inventory, plans: Sequence[HostPlan], rendered: Mapping[str, list[RenderedFile]],
                 options: ExportOptions, balancers: Sequence[BalancerPlan] = (),
                 configs: Mapping[str, str] | None = None, fronts: Sequence[BalancerPlan] = ()) -> list[ExportFile]:
    """Every file of the export. `rendered` maps each host to its files rendered with host_files (masked).
    `balancers` are the balancer hosts the export deploys, `configs` each one's configuration rendered from
    masked_balancer; `fronts` every balancer of the inventory, which the cycles drive (also those --limit left
    out: they front the exported instances all the same)."""
    vault = _Vault()
    driven = bool(fronts or balancers)
    files = [ExportFile(rel, regions(_content(rel), driven)) for rel in STATIC]
    files.append(ExportFile(f"{ROLE}/files/ernie_host.py", host_program(balancers=driven), 0o755))
    for plan in plans:
        for f in rendered[plan.name]:
            name = f.path.rsplit("/", 1)[1]
            if f.path.startswith(UNIT_DIR + "/"):
                files.append(ExportFile(f"{ROLE}/files/hosts/{plan.name}/{name}", f.content))
            elif f.path.startswith(ENV_DIR + "/"):
                files.append(ExportFile(f"{ROLE}/templates/hosts/{plan.name}/{name}.j2", env_template(f.content, plan),
                                        0o600))
        instances = host_vars(plan, fronting(plan, fronts) if driven else None)
        files.append(ExportFile(f"{ROLE}/vars/hosts/{plan.name}.yml",
                                _yaml(instances, f"---\n# {plan.name}'s plan, from ernie-deploy export.\n")))
    files += inventory_files(inventory, [p.name for p in plans], vault, [b.host for b in balancers])
    # After the inventory: a balancer's API key is an inventory value already named there.
    files += balancer_files(balancers, configs or {}, vault)
    files += playbook_files(options, bool(balancers))
    names = sorted(set(vault.names.values()))
    example = ("# The vault variables the inventory refers to. Put the real values in an encrypted file:\n"
               "#   ansible-vault create vault.yml     (then: ansible-playbook site.yml -e @vault.yml "
               "--ask-vault-pass)\n# or inject them as extra variables from an AWX credential (docs/ansible.md).\n")
    files.append(ExportFile("vault.example.yml", example + "".join(f"{n}: CHANGE_ME\n" for n in names)))
    return files
