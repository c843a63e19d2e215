"""Rendering: a HostPlan → systemd unit and 0600 environment file per instance (Jinja2, StrictUndefined).

Every value that reaches a unit file is validated or escaped here, in one place: systemd expands `%`
specifiers in every field it loads with them (Description=, Environment=, ExecStart=, …), expands `$VAR`
references in ExecStart= only, splits words on whitespace and honours C-style escapes inside double quotes
(systemd.service(5), "Command lines"; systemd.exec(5), Environment=; systemd.unit(5), "Specifiers"). The
rules each escape relies on, with their sources: docs/systemd.md#values-in-unit-files.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ernie_deploy.errors import DeployError, RenderError
from ernie_deploy.planning import restarts
from ernie_deploy.planning.bulk import collector_paused
from ernie_deploy.planning.cpubackend import BIND_ENV, KVCACHE_ENV
from ernie_deploy.planning.findings import Finding, Severity
from ernie_deploy.planning.hostpaths import ENV_DIR, UNIT_DIR
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.versions import parse_version, version_facts

if TYPE_CHECKING:
    import jinja2

TEMPLATE_NAMES = ("vllm.service.j2", "vllm.env.j2")
# C0/C1 controls and Unicode line separators: none belongs in a unit file, several end a line somewhere.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./%$-]+")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_EXECUTABLE = re.compile(r"/[A-Za-z0-9._/+-]+")
_BIND_HOST = re.compile(r"[A-Za-z0-9.:-]+")
# Environment variables ernie-deploy sets itself or keeps out of world-readable unit files.
UNSAFE = "unsafe-value"  # the finding code of a value that cannot go into a unit or env file
_RESERVED_ENV = {"CUDA_VISIBLE_DEVICES", "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}
# vLLM's CPU backend variables have settings of their own, which planning checks against each instance.
_CPU_ENV = {KVCACHE_ENV: "vllm_cpu_kvcache_space", BIND_ENV: "vllm_cpu_omp_threads_bind"}


@dataclass(frozen=True)
class RenderedFile:
    path: str  # absolute path on the host
    content: str
    mode: int
    secret: bool = False

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content.encode()).hexdigest()


def _reject_control(value: str, what: str, host: str, *, secret: bool = False) -> None:
    if _CONTROL.search(value):
        shown = "" if secret else f": {value!r}"  # a secret's value never reaches a message, log or JSON
        raise RenderError(f"{what} contains a control character (newline, tab, …){shown}", where=host,
                          hint="remove it; a newline would start a new line in the unit file")


def systemd_word(value: str, what: str, host: str) -> str:
    """One ExecStart= word, escaped so systemd passes it through byte for byte: `$` is doubled because
    ExecStart= expands `$NAME` and `${NAME}`."""
    _reject_control(value, what, host)
    return _quoted_word(value.replace("$", "$$"))


def environment_word(value: str, what: str, host: str) -> str:
    """One Environment= word (`KEY=value`), escaped so the process gets the value byte for byte. `$` stays
    as it is: Environment= does no variable expansion, so a doubled `$` would arrive doubled."""
    _reject_control(value, what, host)
    return _quoted_word(value)


def _quoted_word(value: str) -> str:
    """Backslashes and double quotes escaped (C escapes inside double quotes), `%` doubled (specifiers), and
    the word double-quoted unless it is plain."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return escaped if _PLAIN_WORD.fullmatch(escaped) else f'"{escaped}"'


def no_specifiers(text: str) -> str:
    """Text for a unit field systemd loads with specifier expansion (Description=, User=, paths): `%h` would
    become the user's home directory, so every `%` is doubled."""
    return text.replace("%", "%%")


def unescape_word(word: str) -> str:
    """The argument systemd passes for one ExecStart= word written by systemd_word (its inverse)."""
    if len(word) >= 2 and word[0] == word[-1] == '"':
        word = word[1:-1]
    out, i = [], 0
    while i < len(word):
        pair = word[i:i + 2]
        if pair in ("\\\\", '\\"', "%%", "$$"):
            out.append(pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return "".join(out)


def _value_word(value: str, what: str, host: str) -> str:
    """A flag's value or a positional: must not look like a flag to vLLM's argument parser."""
    if value.startswith("-") or not value:
        raise RenderError(f"{what} must not be empty or start with '-': {value!r}", where=host)
    return systemd_word(value, what, host)


def _env_assignment(key: str, value: str, host: str) -> str:
    if not _ENV_KEY.fullmatch(key):
        raise RenderError(f"environment variable name {key!r} is not valid", where=host,
                          hint="use letters, digits and underscores, not starting with a digit")
    return environment_word(f"{key}={value}", f"environment variable {key}", host)


def _env_file_line(key: str, value: str, host: str) -> str:
    """KEY='value': systemd reads single-quoted env-file values literally, with no escapes or expansion."""
    _reject_control(value, f"secret {key}", host, secret=True)
    if "'" in value or "\\" in value:
        raise RenderError(f"secret {key} contains a quote or backslash, which the env file cannot hold safely",
                          where=host, hint="use a token without ' or \\")
    return f"{key}='{value}'"


def exec_start(plan: HostPlan, inst: InstancePlan) -> str:
    return " ".join(exec_words(plan, inst))


def exec_words(plan: HostPlan, inst: InstancePlan) -> list[str]:
    """ExecStart= as a list of words, each already escaped for systemd."""
    host = plan.name
    if not _EXECUTABLE.fullmatch(plan.bin):
        raise RenderError(f"vllm_bin must be an absolute path of plain characters, got {plan.bin!r}", where=host)
    if not _BIND_HOST.fullmatch(inst.host):
        raise RenderError(f"vllm_host must be an address or host name, got {inst.host!r}", where=host)
    words = [plan.bin, "serve", _value_word(plan.model_path, "vllm_model", host),
             "--served-model-name", _value_word(inst.served_model_name, "vllm_served_model_name", host),
             "--host", inst.host, "--port", str(inst.port),
             "--tensor-parallel-size", str(inst.tensor_parallel_size)]
    if inst.pipeline_parallel_size != 1:
        words += ["--pipeline-parallel-size", str(inst.pipeline_parallel_size)]
    if inst.max_model_len is not None:
        words += ["--max-model-len", str(inst.max_model_len)]
    words += ["--gpu-memory-utilization", repr(float(inst.gpu_memory_utilization))]
    if _has_shutdown_timeout(plan.version):
        words += ["--shutdown-timeout", str(plan.drain_timeout)]
    words += [systemd_word(arg, "vllm_extra_args item", host) for arg in inst.args]
    return words


@lru_cache(maxsize=64)  # a fleet pins a handful of versions; planning and rendering both ask, per instance
def _has_shutdown_timeout(version: str) -> bool:
    return parse_version(version) >= version_facts().flags["--shutdown-timeout"].since


def environment(plan: HostPlan, inst: InstancePlan) -> list[str]:
    host = plan.name
    for key in plan.env:
        if key in _RESERVED_ENV:
            raise RenderError(f"vllm_env must not set {key}", where=host,
                              hint="GPUs come from the plan; secrets go in vllm_api_key / hf_token")
        if key in _CPU_ENV:
            raise RenderError(f"vllm_env must not set {key}", where=host,
                              hint=f"set {_CPU_ENV[key]} instead: the plan checks it against each instance")
    cpu = {KVCACHE_ENV: inst.cpu_kvcache_space, BIND_ENV: inst.cpu_omp_threads_bind}
    pairs = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in inst.gpus),
        # Usage stats would otherwise be sent to stats.vllm.ai from every host.
        "VLLM_NO_USAGE_STATS": "1",
        # Unbuffered output so start-up lines reach the journal as they happen.
        "PYTHONUNBUFFERED": "1",
        **{k: str(v) for k, v in cpu.items() if v is not None},
        **plan.env,
    }
    return [_env_assignment(k, str(v), host) for k, v in pairs.items()]


def templates_dir(user_dir: Path | None = None) -> Path:
    """The user's template directory, else the packaged copy (wheel), else the source tree's templates/."""
    if user_dir is not None:
        missing = [n for n in TEMPLATE_NAMES if not (user_dir / n).is_file()]
        if missing:
            raise RenderError(f"template directory lacks {', '.join(missing)}", where=str(user_dir),
                              hint="copy the defaults from ernie-deploy's templates/ and edit them")
        return user_dir
    packaged = Path(str(resources.files("ernie_deploy") / "templates"))
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "templates"


def environment_for_templates(directory: Path) -> jinja2.Environment:
    import jinja2  # only where templates are rendered: `plan` validates values without them

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # systemd units, not HTML; escaping is done per value above
        auto_reload=False,  # one run renders many hosts; re-checking template mtimes per host is waste
    )


def unit_environment(directory: Path | None = None) -> jinja2.Environment:
    """The Jinja environment of the unit and env templates (the bundled ones, or --templates DIR), both compiled
    now: a template that cannot be read or parsed is one error naming its file and line (exit 5), before any
    host is planned, rendered or touched."""
    import jinja2

    env = environment_for_templates(templates_dir(directory))
    for name in TEMPLATE_NAMES:
        try:
            env.get_template(name)
        except jinja2.TemplateSyntaxError as exc:
            raise RenderError(f"template syntax error: {exc.message}", where=f"{exc.filename}:{exc.lineno}",
                              hint="fix the Jinja syntax at that line") from None
        except jinja2.TemplateNotFound:
            raise RenderError(f"no template {name} in {templates_dir(directory)}", where=str(directory),
                              hint=f"give a directory holding {' and '.join(TEMPLATE_NAMES)}") from None
        except (OSError, UnicodeDecodeError, jinja2.TemplateError) as exc:
            raise RenderError(f"cannot read template {name}: {exc}", where=str(templates_dir(directory)),
                              hint="give a directory of readable UTF-8 Jinja templates") from None
    return env


def _check_identity(plan: HostPlan) -> None:
    if not _USER.fullmatch(plan.user):
        raise RenderError(f"vllm_user {plan.user!r} is not a valid user name", where=plan.name)
    _reject_control(plan.name, "host name", plan.name)


def unsafe_values(plan: HostPlan) -> list[Finding]:
    """Every value rendering would refuse, as plan errors. build_plan runs this, so `plan`, `render` and
    `deploy` share one validation: what `plan` accepts, `render` renders."""
    found: list[Finding] = []

    def check(step: Callable[[], object]) -> None:
        try:
            step()
        except RenderError as exc:
            if all(f.message != exc.message for f in found):
                found.append(Finding(Severity.ERROR, UNSAFE, exc.message, fix=exc.hint))

    check(partial(_check_identity, plan))
    for inst in plan.instances:
        check(partial(exec_words, plan, inst))
        check(partial(environment, plan, inst))
    for key, secret in sorted(plan.secrets.items()):
        check(partial(_env_file_line, key, secret.reveal(), plan.name))
    return found


def render_host(plan: HostPlan, env: jinja2.Environment) -> list[RenderedFile]:
    """Unit and env file of every instance. Raises RenderError naming the host when its plan has errors."""
    import jinja2  # loaded already: `env` is a jinja2 Environment
    if not plan.ok:
        unsafe = next((f for f in plan.findings if f.code == UNSAFE), None)
        if unsafe is not None:
            raise RenderError(unsafe.message, where=plan.name, hint=unsafe.fix)
        raise RenderError("the plan has errors; nothing is rendered for this host", where=plan.name,
                          hint="run `ernie-deploy plan` and apply the fixes it lists")
    unit_t, env_t = env.get_template(TEMPLATE_NAMES[0]), env.get_template(TEMPLATE_NAMES[1])
    files = []
    for inst in plan.instances:
        env_file = f"{ENV_DIR}/{inst.unit}.env"
        # Text a template may place in any field: specifiers escaped, so `%h` in a name arrives as `%h`.
        text = {
            "host": plan.name, "row": plan.row or "computed fallback", "profile": plan.profile or "",
            "version": plan.version, "unit": inst.unit, "served_model_name": inst.served_model_name,
            "user": plan.user, "env_file": env_file,
        }
        context = {
            **{key: no_specifiers(value) for key, value in text.items()},
            "port": inst.port, "environment": environment(plan, inst), "exec_start": exec_start(plan, inst),
            "stop_timeout": plan.drain_timeout + 15, "restart": restarts.RESTART,
            "restart_sec": restarts.RESTART_SEC, "start_limit_interval": restarts.START_LIMIT_INTERVAL_S,
            "start_limit_burst": restarts.START_LIMIT_BURST,
        }
        secrets = [_env_file_line(k, s.reveal(), plan.name) for k, s in sorted(plan.secrets.items())]
        try:
            unit = unit_t.render(context)
            env_text = env_t.render(unit=inst.unit, secrets=secrets)
        except jinja2.TemplateError as exc:
            raise RenderError(f"template error: {exc}", where=plan.name,
                              hint="check the template directory given with --templates") from exc
        files.append(RenderedFile(f"{UNIT_DIR}/{inst.unit}.service", unit, 0o644))
        files.append(RenderedFile(env_file, env_text, 0o600, secret=True))
    return files


def render_hosts(plans: list[HostPlan], env: jinja2.Environment
                 ) -> tuple[dict[str, list[RenderedFile]], dict[str, DeployError]]:
    """Render every host; a host that cannot be rendered is reported, never stops the others."""
    rendered: dict[str, list[RenderedFile]] = {}
    failed: dict[str, DeployError] = {}
    with collector_paused():
        for plan in plans:
            try:
                rendered[plan.name] = render_host(plan, env)
            except DeployError as exc:
                failed[plan.name] = exc
    return rendered, failed
