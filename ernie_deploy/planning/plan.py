"""Planning: inventory host + recommendation table + model facts → a validated HostPlan. The inventory is read
and checked first (HostInputs: what the facts are gathered with); the plan is built from it once, with the host's
facts when a run has them. Pure: no I/O beyond reading the local data files and model configs it is pointed at."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ernie_deploy.errors import DeployError, InventoryError
from ernie_deploy.inventory.coerce import coerce
from ernie_deploy.planning.bulk import collector_paused
from ernie_deploy.planning.cpubackend import cpu_findings, instance_binds
from ernie_deploy.planning.findings import Finding, Severity
from ernie_deploy.planning.hardware import Catalog, GpuType, load_catalog
from ernie_deploy.planning.models import ModelSpec, bundled_model, load_model, spec_from_config
from ernie_deploy.planning.plantypes import Discovered, HostPlan, InstancePlan, Tuning
from ernie_deploy.planning.recommend import Row, Table, load_table
from ernie_deploy.planning.render import unsafe_values
from ernie_deploy.planning.settings import (
    DEFAULTS,
    MAX_PORT,
    InputErrors,
    Secret,
    Setting,
    host_secrets,
    inventory_settings,
    raise_all,
    venv_bin,
)
from ernie_deploy.planning.validate import check_instance, check_sharing, check_topology, memory_for
from ernie_deploy.planning.versions import Version, parse_version, version_facts


class HostLike(Protocol):
    """What planning needs from an inventory host."""

    @property
    def name(self) -> str: ...
    @property
    def vars(self) -> Mapping[str, Any]: ...
    @property
    def address(self) -> str: ...


@dataclass
class PlanContext:
    """Shared, read-only inputs of a planning run (caches model configs across hosts)."""

    catalog: Catalog
    table: Table
    base_dir: Path = field(default_factory=Path.cwd)  # relative vllm_model_config paths start here
    _models: dict[str, ModelSpec] = field(default_factory=dict)

    @classmethod
    def load(cls, table_path: Path | None = None, base_dir: Path | None = None) -> PlanContext:
        catalog = load_catalog()
        return cls(catalog, load_table(catalog, table_path), base_dir or Path.cwd())

    def model(self, model: str, config: str | None, where: str) -> ModelSpec:
        key = f"{model}|{config}"
        if key not in self._models:
            if config:
                path = Path(config)
                self._models[key] = load_model(path if path.is_absolute() else self.base_dir / path)
            else:
                spec = bundled_model(model)
                if spec is None:
                    raise DeployError(f"no model config known for {model!r}", where=where,
                                      hint="set vllm_model_config to a local copy of the model's config.json")
                self._models[key] = spec
        return self._models[key]


def _source_config(ctx: PlanContext, source: Any) -> str | None:
    """A local vllm_model_source with a config.json plans the model before provisioning has copied it."""
    if not isinstance(source, str) or source.startswith("hf://"):
        return None
    path = Path(source).expanduser()
    path = path if path.is_absolute() else ctx.base_dir / path
    return str(path) if (path / "config.json").is_file() else None


INVENTORY_SOURCE = "inventory variable"


def _resolve(layers: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Setting]:
    """Each setting comes from the last layer that sets it; that layer's label becomes its source."""
    winner: dict[str, tuple[Any, str]] = {}
    for label, values in layers:
        for name, value in values.items():
            winner[name] = (value, label)
    return {name: Setting(*winner[name]) for name in sorted(winner)}


def _gpu(host: HostLike, catalog: Catalog) -> tuple[GpuType, int]:
    model = host.vars.get("gpu_model")
    count = coerce(host.vars.get("gpu_count"), (int,))
    if not isinstance(model, str) or not model:
        raise InventoryError("gpu_model is not set", where=host.name,
                             hint=f"set gpu_model to one of: {', '.join(catalog.names())}")
    gpu = catalog.lookup(model)
    if gpu is None:
        raise InventoryError(f"unknown GPU model {model!r}", where=host.name,
                             hint=f"use an nvidia-smi name from the catalog: {', '.join(catalog.names())}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InventoryError(f"gpu_count must be a positive integer, got {count!r}", where=host.name,
                             hint="set gpu_count to the number of GPUs in the host")
    return gpu, count


def _fallback(model: ModelSpec, gpu_count: int) -> dict[str, Any]:
    """Computed settings for hardware without a table row: the largest TP the GPUs allow."""
    return {"tensor_parallel_size": model.valid_tp_sizes(limit=gpu_count)[-1]}


def _layers(table: Table, row: Row | None, fallback: Mapping[str, Any], inv: Mapping[str, Any],
            profile_name: str, profile_from_inventory: bool) -> list[tuple[str, Mapping[str, Any]]]:
    profile = table.profiles[profile_name]
    profile_values = {"max_model_len": profile.max_model_len} if profile.max_model_len is not None else {}
    layers: list[tuple[str, Mapping[str, Any]]] = [
        ("default", DEFAULTS),
        (f"table defaults ({table.path})", table.defaults),
        (f"profile {profile_name}", profile_values),
    ]
    if row is not None:
        layers.append((f"row {row.name}", row.settings))
    if fallback:
        layers.append(("computed fallback (no table row)", fallback))
    if profile_from_inventory:
        # An operator who picks a profile for a host wants its context length, not the row's.
        layers.append((f"profile {profile_name} (chosen by vllm_profile)", profile_values))
    layers.append((INVENTORY_SOURCE, {k: v for k, v in inv.items()}))
    return layers


@dataclass(frozen=True)
class HostInputs:
    """A host's inventory, read and checked before anything connects: what its facts are gathered with and what
    its plan is built from, once those facts are in. Reading it raises every error that needs no facts."""

    host: HostLike
    inv: dict[str, Any]  # the vllm_* variables, validated
    secrets: dict[str, Secret]
    gpu: GpuType  # as the inventory declares them
    gpu_count: int
    row: Row | None
    base: dict[str, Any]  # defaults < table defaults < row < inventory, without sources
    model: ModelSpec  # from vllm_model_config, a local vllm_model_source or the bundled configs
    profile: str
    version_text: str  # vllm_version, or the default version
    version: Version
    bin: str
    user: str

    @property
    def model_path(self) -> str:
        return str(self.base["model"])


def read_inputs(host: HostLike, ctx: PlanContext) -> HostInputs:
    """The host's inventory, checked; raises DeployError on bad input."""
    where = host.name
    problems: list[InventoryError] = []
    inv: dict[str, Any] = {}
    try:
        inv = inventory_settings(host.vars, where)
    except InventoryError as exc:
        problems += exc.problems if isinstance(exc, InputErrors) else [exc]
    try:
        gpu, gpu_count = _gpu(host, ctx.catalog)
    except InventoryError as exc:
        problems.append(exc)
    raise_all(problems, where)  # every input problem at once, before anything is derived from them
    table = ctx.table
    row = table.match(gpu, gpu_count)
    base = {**DEFAULTS, **table.defaults, **(row.settings if row else {}), **inv}
    model_path = str(base["model"])
    model = ctx.model(model_path, base.get("model_config") or _source_config(ctx, base.get("model_source")), where)
    if row is None and not base.get("allow_fallback"):
        rows = "; ".join(r.describe() for r in table.rows)
        raise DeployError(
            f"no row of the recommendation table matches {gpu_count} × {gpu.name}", where=where,
            hint=f"known rows: {rows}. Add a row to {table.path}, or set vllm_allow_fallback: true "
                 "to compute TP and context from the profile")
    profile_name = str(base.get("profile") or "dev")
    table.profile(profile_name, where)
    version_text = str(base.get("version") or version_facts().default)
    # One venv per version, so a version change is a unit change (docs/provisioning.md).
    bin_ = str(base["bin"]) if "bin" in base else venv_bin(version_text)
    version = parse_version(version_text, f"{where}: vllm_version")
    count, port = int(base["instances"]), int(base.get("port", 8000))
    if port + count - 1 > MAX_PORT:
        raise InventoryError(f"vllm_port {port} with vllm_instances {count} puts the last instance on port "
                             f"{port + count - 1}, above {MAX_PORT}", where=where,
                             hint=f"set vllm_port to {MAX_PORT - count + 1} or lower (instance k listens on "
                                  "vllm_port + k)")
    secrets = host_secrets(host.vars, where)
    if "api_key" in base:
        secrets["VLLM_API_KEY"] = base["api_key"]
    return HostInputs(host=host, inv=inv, secrets=secrets, gpu=gpu, gpu_count=gpu_count, row=row, base=base,
                      model=model, profile=profile_name, version_text=version_text, version=version, bin=bin_,
                      user=str(base["user"]))


def plan_host(host: HostLike, ctx: PlanContext) -> HostPlan:
    """Plan one host from its inventory variables alone. Bad input becomes an error finding, so one bad host
    never hides the others."""
    try:
        inputs = read_inputs(host, ctx)
    except DeployError as exc:
        return _failed(host, exc)
    return build_plan(inputs, ctx)


def build_plan(inputs: HostInputs, ctx: PlanContext, discovered: Discovered | None = None) -> HostPlan:
    """The host's plan from its checked inventory and, when given, what the host itself reported."""
    try:
        return _build(inputs, ctx, discovered)
    except DeployError as exc:
        return _failed(inputs.host, exc)


def input_errors(exc: DeployError) -> list[Finding]:
    """One finding per input problem: InputErrors carries several, each with its own fix."""
    problems = exc.problems if isinstance(exc, InputErrors) else (exc,)
    return [Finding(Severity.ERROR, "input", p.message, fix=p.hint) for p in problems]


def _failed(host: HostLike, exc: DeployError) -> HostPlan:
    return HostPlan(
        name=host.name, address=host.address, gpu=None, gpu_count=0, row=None, profile=None, model=None,
        model_path="", version="", bin="", user="", drain_timeout=0, env={}, secrets={}, settings={},
        tuning=_tuning(DEFAULTS), instances=(), findings=tuple(input_errors(exc)),  # never rolled out: defaults do
    )


def _tuning(values: Mapping[str, Any]) -> Tuning:
    return Tuning(startup_budget=float(values["startup_budget"]), stable_seconds=float(values["stable_seconds"]),
                  keep_releases=int(values["keep_releases"]), share_gpus=bool(values["share_gpus"]),
                  extra_args=tuple(values.get("extra_args", ())))


def _discovered_gpu(host: HostLike, catalog: Catalog, found: Discovered) -> tuple[GpuType, int]:
    """The host's real GPUs; inventory declarations that disagree are errors naming both."""
    if not found.gpu_count or not found.gpu_name:
        raise DeployError(f"no GPUs found: {found.gpu_error or 'nvidia-smi listed none'}", where=host.name,
                          hint="install the NVIDIA driver (nvidia-smi must work) or remove the host from the play")
    known = catalog.lookup(found.gpu_name)
    gpu = known or GpuType(found.gpu_name, (), found.gpu_memory_mib or 0, bool(found.nvlink), "")
    gpu = replace(gpu, memory_mib=found.gpu_memory_mib or gpu.memory_mib,
                  nvlink=gpu.nvlink if found.nvlink is None else found.nvlink)
    declared_model, declared_count = host.vars.get("gpu_model"), coerce(host.vars.get("gpu_count"), (int,))
    if isinstance(declared_model, str) and catalog.lookup(declared_model) != known:
        raise DeployError(f"gpu_model: inventory says {declared_model!r}, nvidia-smi found {found.gpu_name!r}",
                          where=host.name, hint=f"set gpu_model: {found.gpu_name} (or fix the host)")
    if declared_count is not None and declared_count != found.gpu_count:
        raise DeployError(f"gpu_count: inventory says {declared_count}, nvidia-smi found {found.gpu_count}",
                          where=host.name, hint=f"set gpu_count: {found.gpu_count}, or check the host's GPUs")
    return gpu, found.gpu_count


def _discovered_model(inputs: HostInputs, found: Discovered) -> ModelSpec:
    """The model as the host has it: its own config.json, which vllm_user must be able to read."""
    where, model_path = inputs.host.name, inputs.model_path
    if found.model_config is None:
        raise DeployError(f"no readable config.json under {model_path} on the host: {found.model_error}",
                          where=where, hint="set vllm_model_source and run `ernie-deploy provision --limit "
                                            f"{where}`, or set vllm_model to where the model is")
    if found.model_readable is False:
        # Facts are read as root; vLLM runs as vllm_user and would fail to open the file.
        raise DeployError(f"{model_path.rstrip('/')}/config.json is not readable by vllm_user "
                          f"{inputs.base.get('user', 'vllm')!r} (vLLM runs as that user)", where=where,
                          hint=f"make the model directory readable: chmod -R o+rX {model_path} (or chown it to "
                               "that user)")
    return spec_from_config(found.model_config, posixpath.basename(model_path.rstrip("/")),
                            f"{where}:{model_path.rstrip('/')}/config.json")


def _discovered_version(inputs: HostInputs, found: Discovered) -> str:
    """The vLLM the host has, which must be the one vllm_version pins."""
    where = inputs.host.name
    if found.vllm_version is None:
        raise DeployError(f"no vLLM at {inputs.bin} on the host: {found.vllm_error}", where=where,
                          hint=f"install it with `ernie-deploy provision --limit {where}`, or set "
                               "vllm_bin to where it is")
    pinned = inputs.inv.get("version")
    if "version" in inputs.inv and parse_version(str(pinned)) != parse_version(found.vllm_version):
        raise DeployError(f"vllm_version pins {pinned}, but {inputs.bin} is vLLM {found.vllm_version}", where=where,
                          hint=f"install the pinned version with `ernie-deploy provision --limit {where}`, "
                               "or change vllm_version")
    return found.vllm_version


def _build(inputs: HostInputs, ctx: PlanContext, discovered: Discovered | None) -> HostPlan:
    host = inputs.host
    gpu, gpu_count, model = inputs.gpu, inputs.gpu_count, inputs.model
    version_text, version = inputs.version_text, inputs.version
    if discovered is not None:
        # GPUs that disagree with the inventory's are errors, so the table row read from the inventory holds.
        gpu, gpu_count = _discovered_gpu(host, ctx.catalog, discovered)
        model = _discovered_model(inputs, discovered)
    fallback = _fallback(model, gpu_count) if inputs.row is None else {}
    settings = _resolve(_layers(ctx.table, inputs.row, fallback, inputs.inv, inputs.profile, "profile" in inputs.inv))
    origin = getattr(host.vars, "origin", None)  # an inventory read by the CLI knows each variable's file
    if callable(origin):
        settings = {n: replace(s, where=str(origin(f"vllm_{n}"))) if s.source == INVENTORY_SOURCE else s
                    for n, s in settings.items()}
    if "bin" not in settings:
        settings["bin"] = Setting(inputs.bin, f"default for vLLM {version_text}")
    if discovered is not None:
        version_text = _discovered_version(inputs, discovered)
        version = parse_version(version_text, f"{host.name}: vllm_version")

    def value(name: str, default: Any = None) -> Any:
        return settings[name].value if name in settings else default

    instances = _instances(ctx, model, gpu, gpu_count, value)
    findings: list[Finding] = []
    for inst in instances:
        findings += check_instance(inst, model, gpu, gpu_count, version, version_text)
    if instances and instances[0].cpu_kvcache_space is None and all(f.severity is not Severity.ERROR
                                                                    for f in findings):
        # GPU layout advice, once per host; instances on vLLM's CPU backend have no GPUs to waste.
        findings += check_topology(instances, model, gpu, gpu_count)
    findings += check_sharing(instances, gpu, version)
    findings += _layout_findings(instances, gpu_count, bool(value("share_gpus")))
    env = dict(value("env", {}))
    findings += cpu_findings(instances, value("cpu_kvcache_space"), value("cpu_omp_threads_bind"), version_text, env)
    plan = HostPlan(
        name=host.name, address=host.address, gpu=gpu, gpu_count=gpu_count,
        row=inputs.row.name if inputs.row else None, profile=inputs.profile, model=model,
        model_path=inputs.model_path, version=version_text, bin=inputs.bin, user=inputs.user,
        drain_timeout=int(value("drain_timeout")), env=env, secrets=dict(inputs.secrets), settings=settings,
        tuning=_tuning({name: s.value for name, s in settings.items()}), instances=tuple(instances), findings=(),
    )
    found = _ordered(findings + unsafe_values(plan))
    if any(f.severity is Severity.ERROR for f in found):
        found = [f for f in found if f.code != "idle-gpus"]  # the errors' fixes change the layout anyway
    ignored, problem = _ignored(host.vars.get(IGNORE_VAR))
    if problem is not None:
        found.insert(0, problem)
    silenced = [f for f in found if f.code in ignored and f.severity is not Severity.ERROR]
    return replace(plan, findings=tuple(f for f in found if f not in silenced), silenced=tuple(silenced))


# The finding codes a host (or group) silences, for a deliberate choice: `ernie_ignore: [tp-pcie]`. Errors are
# never silenced: vLLM would refuse to start whatever the inventory says.
IGNORE_VAR = "ernie_ignore"


def _ignored(value: Any) -> tuple[frozenset[str], Finding | None]:
    if value is None:
        return frozenset(), None
    if isinstance(value, str):  # an INI inventory or -e gives a string: comma-separated codes
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        return frozenset(), Finding(Severity.ERROR, "input", f"{IGNORE_VAR} must be a list of finding codes",
                                    fix=f"write {IGNORE_VAR}: [tp-pcie, idle-gpus] (the codes plan prints in brackets)")
    return frozenset(value), None


def _instances(ctx: PlanContext, model: ModelSpec, gpu: GpuType, gpu_count: int, value: Any) -> list[InstancePlan]:
    count = int(value("instances", 1))
    tp = int(value("tensor_parallel_size", 1))
    pp = int(value("pipeline_parallel_size", 1))
    per = max(tp, 1) * max(pp, 1)
    share = bool(value("share_gpus"))
    mml = value("max_model_len")
    util = float(value("gpu_memory_utilization", 0.9))
    base_name = str(value("served_model_name") or posixpath.basename(str(value("model")).rstrip("/")))
    # Replicas behind one load balancer serve one name; a per-replica suffix is opt-in.
    suffix = bool(value("served_model_name_suffix", False))
    port = int(value("port", 8000))
    profile = ctx.table.profiles[str(value("profile") or "dev")]
    args = tuple(profile.args) + tuple(value("extra_args", []))
    kv_space = value("cpu_kvcache_space")
    binds = instance_binds(value("cpu_omp_threads_bind"), count)
    out = []
    for k in range(count):
        first = (k * per) % gpu_count if share else k * per
        gpus = tuple(g for g in range(first, first + per) if g < gpu_count or share)
        gpus = tuple(g % gpu_count for g in gpus) if share else gpus
        out.append(InstancePlan(
            index=k, unit=f"ernie-vllm-{k}", port=port + k, host=str(value("host", "0.0.0.0")),
            gpus=tuple(dict.fromkeys(gpus)), served_model_name=f"{base_name}-{k}" if suffix and k else base_name,
            tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=mml,
            gpu_memory_utilization=util, args=args,
            memory=memory_for(tp, pp, mml, util, model, gpu, kv_space),
            cpu_kvcache_space=kv_space, cpu_omp_threads_bind=binds[k],
        ))
    return out


def _layout_findings(instances: list[InstancePlan], gpu_count: int, share: bool) -> list[Finding]:
    need = sum(i.tensor_parallel_size * i.pipeline_parallel_size for i in instances)
    if need < gpu_count and instances and not share:
        return [_idle_gpus(instances, gpu_count)]
    if share or need <= gpu_count or len(instances) < 2:
        return []
    per = instances[0].tensor_parallel_size * instances[0].pipeline_parallel_size
    return [Finding(
        Severity.ERROR, "gpus-exhausted",
        f"{len(instances)} instances × {per} GPUs need {need} GPUs; the host has {gpu_count}",
        fix=f"set vllm_instances to {max(1, gpu_count // max(per, 1))}, or vllm_share_gpus: true with "
            "memory fractions that sum to ≤ 1 per GPU")]


def _idle_gpus(instances: list[InstancePlan], gpu_count: int) -> Finding:
    """GPUs no instance uses: paid for and idle (3 instances on 4 GPUs, a TP-2 row on a 4-GPU host)."""
    used = {g for i in instances for g in i.gpus}
    idle = [g for g in range(gpu_count) if g not in used]
    per = instances[0].tensor_parallel_size * instances[0].pipeline_parallel_size
    fits = gpu_count // max(per, 1)
    fix = (f"set vllm_instances to {fits} (one instance per {per} GPU(s))" if fits > len(instances) else
           f"set vllm_tensor_parallel_size so the instances use all {gpu_count} GPUs")
    return Finding(Severity.ADVICE, "idle-gpus",
                   f"GPU(s) {', '.join(map(str, idle))} of {gpu_count} are used by no instance", fix=fix)


def _ordered(findings: list[Finding]) -> list[Finding]:
    rank = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.ADVICE: 2, Severity.INFO: 3}
    return sorted(findings, key=lambda f: rank[f.severity])


def plan_hosts(hosts: list[HostLike], ctx: PlanContext) -> list[HostPlan]:
    with collector_paused():
        return [plan_host(h, ctx) for h in hosts]
