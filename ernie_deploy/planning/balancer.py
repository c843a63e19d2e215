"""The fleet's load balancers, planned from the inventory: which instances each fronts, under which names.

Hosts of the inventory group `vllm_balancers` run HAProxy (the distribution's package) in front of every vLLM
instance of the inventory, one backend per served model name. ernie-deploy renders its configuration from this
plan, installs and reloads it, and drives it through HAProxy's runtime API during rolling restarts (drain before
an instance stops, ready after it passed the readiness gate): docs/balancer.md.

Who calls what: `split_hosts` keeps balancer hosts apart from vLLM hosts (every command that works on instances
uses only the first list); `plan_balancers` plans each balancer from the plans of ALL the inventory's vLLM hosts
(a balancer fronts every instance, whatever --limit selects); `render_balancer` writes its HAProxy configuration.

Pure: no I/O besides checking that a user's template exists here and reading it in `render_balancer`.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ernie_deploy.errors import DeployError, InventoryError, RenderError
from ernie_deploy.planning.plan import HostLike, PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.settings import BALANCER_TYPES, Secret, Setting, check_type, raise_all

if TYPE_CHECKING:
    import jinja2

GROUP = "vllm_balancers"
KIND = "haproxy"
TEMPLATE_NAME = "haproxy.cfg.j2"
# What Debian's haproxy.service runs without a drop-in (its Environment= CONFIG; the package's tmpfiles.d entry).
DEBIAN_CONFIG = "/etc/haproxy/haproxy.cfg"
DEBIAN_SOCKET_DIR = "/run/haproxy"
FRONTEND = "vllm"  # the frontend's name; no backend may take it
DEFAULTS: dict[str, Any] = {
    "balancer_port": 8080,
    "balancer_bind": "0.0.0.0",
    "balancer_admin_socket": "/run/haproxy/admin.sock",
    "balancer_config": "/etc/haproxy/haproxy.cfg",
    "balancer_check_interval": 2,
}
MAX_WEIGHT = 256  # HAProxy's largest server weight (configuration.txt 5.2, "weight")
# HAProxy's proxy and server names: letters, digits, '-', '_', '.' and ':' (configuration.txt 4, "Proxies").
_HAPROXY_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_NOT_IN_BACKEND_NAME = re.compile(r"[^A-Za-z0-9_.-]")
# A served model name goes into the routing rule and the check's JSON body: nothing that quoting or JSON would
# have to carry (quotes, backslashes, '$', '#', spaces, control characters).
_MODEL = re.compile(r"[A-Za-z0-9_.:/@+=-]+")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_HOST_PATH = re.compile(r"/[A-Za-z0-9_.+/-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_WILDCARDS = ("0.0.0.0", "::", "")
# The longest unix socket path Linux takes (sun_path holds 108 bytes with the terminating NUL; unix(7)).
_MAX_SOCKET_PATH = 107

H = TypeVar("H", bound="GroupedHost")


class GroupedHost(HostLike, Protocol):
    """An inventory host with its groups (all of them, the parents of its groups included)."""

    @property
    def groups(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class BalancerServer:
    """One vLLM instance as a server line of a backend. `name` is `<inventory host>-<instance index>`, the
    name docs/hooks.md gives it too, so a balancer configured by hand for the hooks keeps working."""

    name: str
    host: str  # the vLLM host's inventory name
    index: int  # the instance index k
    unit: str  # its systemd unit, without ".service"
    address: str  # where the balancer reaches the instance
    port: int
    weight: int  # HAProxy weight, 1..256: the instance's capacity


@dataclass(frozen=True)
class BalancerBackend:
    """The instances that serve one model name; requests whose JSON body names that model go here."""

    name: str  # HAProxy proxy name derived from the model name (letters, digits, '-', '_', '.')
    model: str  # the served model name, as clients send it in "model"
    servers: tuple[BalancerServer, ...]
    # The instances' VLLM_API_KEY: the health check sends it (vLLM guards /v1 with it). Never printed.
    api_key: Secret | None = field(default=None, repr=False)


@dataclass(frozen=True)
class BalancerPlan:
    host: str  # the balancer's inventory name
    address: str  # the address SSH uses for it
    bind: str  # the address HAProxy listens on
    port: int
    admin_socket: str  # HAProxy's runtime API socket on the balancer host
    config_path: str  # where the rendered configuration goes on the balancer host
    check_interval: float  # seconds between health checks of one server
    backends: tuple[BalancerBackend, ...]
    kind: str = KIND
    template: str | None = None  # the user's template (vllm_balancer_template, resolved), else the bundled one

    def servers(self) -> list[tuple[BalancerBackend, BalancerServer]]:
        return [(b, s) for b in self.backends for s in b.servers]

    def server_for(self, host: str, index: int) -> tuple[BalancerBackend, BalancerServer] | None:
        """The backend and server of instance `index` on vLLM host `host`, or None when this balancer does not
        front it."""
        for backend, server in self.servers():
            if server.host == host and server.index == index:
                return backend, server
        return None


def is_balancer(host: GroupedHost) -> bool:
    return GROUP in host.groups


def split_hosts(hosts: Iterable[H]) -> tuple[list[H], list[H]]:
    """(vLLM hosts, balancer hosts), each in the given order. A host of group `vllm_balancers` (or of a group
    below it) is a balancer and never a vLLM host: to run HAProxy on a GPU box, give the box a second inventory
    name with the same ansible_host."""
    vllm: list[H] = []
    balancers: list[H] = []
    for host in hosts:
        (balancers if is_balancer(host) else vllm).append(host)
    return vllm, balancers


def balancer_settings(host: HostLike, base_dir: Path | None = None) -> dict[str, Setting]:
    """The balancer's variables, validated, each with where its value came from (for `explain`). Raises every
    problem of the host at once: unknown vllm_balancer_* names with the closest known one, wrong types, values
    out of range, a bind that is no IP address, host paths that are not plain absolute paths, a template that
    is not a file here."""
    where = host.name
    problems: list[InventoryError] = []
    found: dict[str, Any] = {}
    for var in host.vars:  # a value is read only where checked (reading may decrypt it: inventory/resolve.py)
        name = var.removeprefix("vllm_")
        if not var.startswith("vllm_balancer_") or name == "balancer_weight":
            continue  # vLLM hosts' variables reach a balancer through group_vars/all: not its business
        if name not in BALANCER_TYPES:
            close = difflib.get_close_matches(var, [f"vllm_{n}" for n in BALANCER_TYPES], n=1)
            problems.append(InventoryError(f"unknown variable {var}", where=where,
                                           hint=f"did you mean {close[0]}?" if close else "see docs/balancer.md"))
            continue
        try:
            found[name] = check_type(name, host.vars[var], where, BALANCER_TYPES)
        except InventoryError as exc:
            problems.append(exc)
    raise_all(problems, where)
    problems += _checked_values(found, where, base_dir or Path.cwd())
    raise_all(problems, where)
    settings = {name: Setting(value, "default") for name, value in DEFAULTS.items()}
    settings.update({name: Setting(value, "inventory variable") for name, value in found.items()})
    return dict(sorted(settings.items()))


def _checked_values(found: dict[str, Any], where: str, base_dir: Path) -> list[InventoryError]:
    """Values of the right type that still cannot be used; `found`'s template becomes its resolved path."""
    problems: list[InventoryError] = []
    bind = found.get("balancer_bind")
    if bind is not None and not _is_ip(bind):
        problems.append(InventoryError(f"vllm_balancer_bind must be an IP address, got {bind!r}", where=where,
                                       hint="set vllm_balancer_bind to an address of the balancer host, 0.0.0.0 "
                                            "(every IPv4 address) or :: (every address)"))
    for name, example in (("balancer_admin_socket", "/run/haproxy/admin.sock"),
                          ("balancer_config", "/etc/haproxy/haproxy.cfg")):
        path = found.get(name)
        if path is not None and (not _HOST_PATH.fullmatch(path) or ".." in path.split("/")):
            problems.append(InventoryError(
                f"vllm_{name} must be an absolute path of letters, digits and ._+-/ without '..', got {path!r}",
                where=where, hint=f"set vllm_{name} to a path such as {example}"))
    socket = found.get("balancer_admin_socket", "")
    if len(socket) > _MAX_SOCKET_PATH:
        problems.append(InventoryError(f"vllm_balancer_admin_socket is {len(socket)} characters long; a unix socket "
                                       f"path may have {_MAX_SOCKET_PATH} at most", where=where,
                                       hint="choose a shorter path, e.g. /run/haproxy/admin.sock"))
    template = found.get("balancer_template")
    if template is not None:
        path = Path(template).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            problems.append(InventoryError(f"vllm_balancer_template {template!r} is not a file ({path})", where=where,
                                           hint="give the path of your copy of ernie-deploy's "
                                                f"templates/{TEMPLATE_NAME}, relative to the inventory's directory"))
        found["balancer_template"] = str(path)
    return problems


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def instance_weight(plan: HostPlan, inst: InstancePlan) -> tuple[int, str]:
    """The instance's HAProxy weight and why: vllm_balancer_weight, else its GPUs (TP × PP) within 1..256."""
    if "balancer_weight" in plan.settings:
        setting = plan.settings["balancer_weight"]
        return int(setting.value), f"vllm_balancer_weight ({setting.source})"
    gpus = inst.tensor_parallel_size * inst.pipeline_parallel_size
    return max(1, min(MAX_WEIGHT, gpus)), "tensor_parallel_size × pipeline_parallel_size"


def plan_balancers(balancer_hosts: Sequence[HostLike], vllm_plans: Sequence[HostPlan],
                   base_dir: Path | None = None) -> list[BalancerPlan]:
    """Each balancer host's plan, fronting every instance of `vllm_plans` (all the inventory's vLLM hosts, in
    inventory order). `base_dir` is where a relative vllm_balancer_template starts (the inventory's directory;
    the working directory when None). Raises DeployError naming the host, the variable and the fix: bad
    balancer variables, a vLLM host whose plan has errors, an instance the configuration cannot name or reach."""
    if not balancer_hosts:
        return []
    backends = _backends(vllm_plans)
    plans = []
    for host in balancer_hosts:
        settings = {name: s.value for name, s in balancer_settings(host, base_dir).items()}
        if _CONTROL.search(host.name):
            raise InventoryError("the host name contains a control character", where=repr(host.name),
                                 hint="rename the host in the inventory")
        for backend in backends:
            for server in backend.servers:
                _check_reachable(host, server, vllm_plans)
        plans.append(BalancerPlan(
            host=host.name, address=host.address, bind=str(settings["balancer_bind"]),
            port=int(settings["balancer_port"]), admin_socket=str(settings["balancer_admin_socket"]),
            config_path=str(settings["balancer_config"]),
            check_interval=float(settings["balancer_check_interval"]), backends=backends,
            template=settings.get("balancer_template")))
    return plans


def _backends(vllm_plans: Sequence[HostPlan]) -> tuple[BalancerBackend, ...]:
    """One backend per served model name, sorted by it; servers in inventory order."""
    if not vllm_plans:
        raise InventoryError(f"the inventory has no vLLM host for group {GROUP} to front",
                             hint="add the GPU hosts to the inventory, or remove the balancer hosts")
    servers: dict[str, list[BalancerServer]] = {}
    keys: dict[str, tuple[str, Secret | None]] = {}  # model → (first host, its API key)
    places: dict[tuple[str, int], str] = {}  # address:port → server
    for plan in vllm_plans:
        if not plan.ok:
            raise DeployError(f"the plan has errors, so the balancers ({GROUP}) cannot be planned: they front "
                              "every instance of the inventory", where=plan.name,
                              hint=f"fix it (`ernie-deploy plan --limit {plan.name}` lists the fixes) or leave "
                                   "the host out of the inventory")
        key = plan.secrets.get("VLLM_API_KEY")
        for inst in plan.instances:
            server = _server(plan, inst)
            model = inst.served_model_name
            if not _MODEL.fullmatch(model):
                raise InventoryError(f"served model name {model!r} cannot be placed in the balancer's "
                                     "configuration (it is matched in requests' JSON)", where=plan.name,
                                     hint="set vllm_served_model_name to letters, digits and _.:/@+=- only")
            first = keys.setdefault(model, (plan.name, key))
            if first[1] != key:
                raise InventoryError(
                    f"instances of model {model!r} use different API keys on {first[0]} and {plan.name}: the "
                    "balancer's health check sends one key per model", where=plan.name,
                    hint="give every host serving the model the same vllm_api_key (or serve them under different "
                         "vllm_served_model_name)")
            other = places.setdefault((server.address, server.port), server.name)
            if other != server.name:
                raise InventoryError(f"instance {server.name} is at {server.address}:{server.port}, as {other} is: "
                                     "the balancer would send it the traffic of two", where=plan.name,
                                     hint="give each inventory host its own ansible_host or vllm_port")
            servers.setdefault(model, []).append(server)
    names = _backend_names(sorted(servers))
    return tuple(BalancerBackend(name=names[model], model=model, servers=tuple(servers[model]),
                                 api_key=keys[model][1]) for model in sorted(servers))


def _server(plan: HostPlan, inst: InstancePlan) -> BalancerServer:
    name = f"{plan.name}-{inst.index}"
    if not _HAPROXY_NAME.fullmatch(name):
        raise InventoryError(f"host name {plan.name!r} cannot name an HAProxy server (letters, digits and -_.: "
                             "only)", where=repr(plan.name),
                             hint="rename the inventory host; ansible_host keeps its address")
    address = plan.address if inst.host in _WILDCARDS else inst.host
    if not (_is_ip(address) or _HOST_NAME.fullmatch(address)):
        raise InventoryError(f"instance {name}'s address {address!r} is neither an IP address nor a host name",
                             where=plan.name, hint="set ansible_host (or vllm_host) to the address the balancer "
                                                   "reaches the instance on")
    weight, _ = instance_weight(plan, inst)
    return BalancerServer(name=name, host=plan.name, index=inst.index, unit=inst.unit, address=address,
                          port=inst.port, weight=weight)


def _check_reachable(balancer: HostLike, server: BalancerServer, vllm_plans: Sequence[HostPlan]) -> None:
    """A loopback bind answers only on its own machine: a balancer elsewhere would see the server DOWN forever."""
    if not _is_ip(server.address) or not ipaddress.ip_address(server.address).is_loopback:
        return
    vllm_address = next(p.address for p in vllm_plans if p.name == server.host)
    if server.address in (vllm_address, balancer.address) or vllm_address == balancer.address:
        return  # the host's own address (the lab's 127.0.0.N), or the balancer on the same machine
    raise InventoryError(f"instance {server.name} binds the loopback address {server.address}, which balancer "
                         f"{balancer.name} ({balancer.address}) cannot reach", where=server.host,
                         hint="set vllm_host to 0.0.0.0 or to an address the balancer reaches")


def _backend_names(models: Sequence[str]) -> dict[str, str]:
    """HAProxy proxy names from model names: other characters become '_', and a clash (with another model's
    name or the frontend's) gets a numbered suffix, in the order of the sorted models."""
    taken = {FRONTEND}
    names = {}
    for model in models:
        base = _NOT_IN_BACKEND_NAME.sub("_", model)
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        names[model] = name
    return names


# -- rendering -------------------------------------------------------------------------------------------------

def haproxy_word(value: object) -> str:
    """One double-quoted word of an HAProxy configuration: backslash, double quote and '$' (which would expand an
    environment variable) escaped (configuration.txt 2.2). Control characters have no place in it."""
    text = str(value)
    if _CONTROL.search(text):
        raise RenderError("a value for the balancer's configuration contains a control character",
                          hint="remove newlines and other control characters from it")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def log_format_literal(value: object) -> str:
    """Text for an argument HAProxy reads as a log-format string (http-check's `hdr`): '%' doubled, so it
    arrives as written (configuration.txt 8.2.4)."""
    return str(value).replace("%", "%%")


def _interval(seconds: float) -> str:
    """HAProxy's time format takes whole units: whole seconds as `2s`, others in milliseconds."""
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{round(seconds * 1000)}ms"


def _listen(bind: str, port: int) -> str:
    return f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"


def template_path(plan: BalancerPlan) -> Path:
    """The template the balancer's configuration is rendered from: the user's, else the bundled one."""
    from ernie_deploy.planning.render import templates_dir

    return Path(plan.template) if plan.template else templates_dir() / TEMPLATE_NAME


def render_balancer(plan: BalancerPlan) -> str:
    """The balancer's HAProxy configuration. Raises RenderError naming the balancer host on a template that
    cannot be read or rendered, or a value that cannot be placed in the file."""
    import jinja2  # only where a configuration is rendered

    from ernie_deploy.planning.render import environment_for_templates

    path = template_path(plan)
    try:
        env = environment_for_templates(path.parent)
        env.filters.update(q=haproxy_word, lf=log_format_literal)
        return _render(env.get_template(path.name), plan)
    except RenderError as exc:
        raise RenderError(exc.message, where=plan.host, hint=exc.hint) from None
    except (OSError, jinja2.TemplateError) as exc:
        raise RenderError(f"template {path}: {type(exc).__name__}: {exc}", where=plan.host,
                          hint="fix the template named by vllm_balancer_template (or remove the variable to use "
                               "the bundled one)") from exc


def _render(template: jinja2.Template, plan: BalancerPlan) -> str:
    backends = [{
        "name": b.name, "model": b.model,
        "api_key": b.api_key.reveal() if b.api_key is not None else None,
        "check_body": json.dumps({"model": b.model, "prompt": "ping", "max_tokens": 1}, separators=(",", ":")),
        "servers": [{"name": s.name, "weight": s.weight, "address": _listen(s.address, s.port)} for s in b.servers],
    } for b in plan.backends]
    return template.render(host=plan.host, listen=_listen(plan.bind, plan.port), admin_socket=plan.admin_socket,
                           interval=_interval(plan.check_interval), backends=backends)



def fleet_plans(hosts: Iterable[GroupedHost], ctx: PlanContext, planned: Sequence[HostPlan] = ()) -> list[HostPlan]:
    """The plan of every vLLM host among `hosts` (pass the whole inventory: the balancers front all of them), in
    their order; a host already in `planned` keeps that plan instead of being planned again."""
    known = {p.name: p for p in planned}
    vllm_hosts, _ = split_hosts(hosts)
    todo = plan_hosts([h for h in vllm_hosts if h.name not in known], ctx)
    known.update((p.name, p) for p in todo)
    return [known[h.name] for h in vllm_hosts]


def unit_dropin(config: str, socket_dir: str) -> str | None:
    """HAProxy's unit drop-in for a configuration or admin socket outside Debian's defaults (None: the unit as
    the package ships it); `deploy` and the Ansible export write this same text. An ExecStartPre line adds to the
    unit's, which has none; /etc/default/haproxy's CONFIG, if set, would override Environment= (systemd.exec:
    EnvironmentFile= wins), so docs/balancer.md says to leave it unset."""
    if config == DEBIAN_CONFIG and socket_dir == DEBIAN_SOCKET_DIR:
        return None
    lines = ["# Written by ernie-deploy: where the balancer's configuration and admin socket live.", "[Service]",
             f"Environment=CONFIG={config}"]
    if socket_dir != DEBIAN_SOCKET_DIR:
        lines.append(f"ExecStartPre=/bin/mkdir -p {socket_dir}")
    return "\n".join(lines) + "\n"
