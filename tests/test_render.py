"""Rendering: golden units, systemd's own verifier, and hostile values that must not break a unit."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, needs_program
from hypothesis import given, settings
from hypothesis import strategies as st
from systemd_words import unsystemd, unsystemd_environment

from ernie_deploy.errors import RenderError
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.plan import PlanContext, plan_hosts
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import environment_for_templates, render_host, systemd_word, templates_dir

GOLDEN = Path(__file__).parent / "golden"
ENV = environment_for_templates(templates_dir())
Plan = Callable[..., HostPlan]
A10 = {"gpu_model": "NVIDIA A10", "gpu_count": 2}


def example_plans() -> list[HostPlan]:
    inventory = load_inventory(ROOT / "inventory/example.yml")
    return [p for p in plan_hosts(list(inventory.select(None)), PlanContext.load()) if p.ok]


@pytest.mark.parametrize("plan", example_plans(), ids=lambda p: p.name)
def test_golden_units(plan: HostPlan) -> None:
    for f in render_host(plan, ENV):
        golden = GOLDEN / plan.name / Path(f.path).name
        if os.environ.get("UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(f.content)
        assert f.content == golden.read_text(), f"{golden} differs; UPDATE_GOLDEN=1 regenerates it"


def test_unit_shape(plan_one: Plan) -> None:
    p = plan_one(**A10, vllm_api_key="sk-secret-1", hf_token="hf_abc", vllm_env={"HF_HUB_OFFLINE": "1"})
    unit, env = render_host(p, ENV)
    assert unit.path == "/etc/systemd/system/ernie-vllm-0.service" and unit.mode == 0o644
    assert env.path == "/etc/ernie-deploy/ernie-vllm-0.env" and env.mode == 0o600 and env.secret
    text = unit.content
    for line in ("Type=simple", "User=vllm", "Restart=always", "StartLimitBurst=5", "LimitNOFILE=65535",
                 "TimeoutStopSec=45",
                 "Environment=CUDA_VISIBLE_DEVICES=0,1", "Environment=HF_HUB_OFFLINE=1",
                 "EnvironmentFile=/etc/ernie-deploy/ernie-vllm-0.env"):
        assert line in text.splitlines(), line
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_line.startswith("ExecStart=/opt/vllm/0.34.0/bin/vllm serve /models/ERNIE-4.5-0.3B-PT ")
    assert "--tensor-parallel-size 2 --max-model-len 4096" in exec_line
    assert "--shutdown-timeout 30" in exec_line
    # Secrets only in the 0600 env file.
    assert "sk-secret-1" not in text and "hf_abc" not in text
    assert "VLLM_API_KEY='sk-secret-1'" in env.content and "HF_TOKEN='hf_abc'" in env.content


def test_stop_timeout_follows_drain_and_old_vllm_gets_no_shutdown_flag(plan_one: Plan) -> None:
    (unit, _) = render_host(plan_one(**A10, vllm_drain_timeout=120, vllm_version="0.11.0"), ENV)
    assert "TimeoutStopSec=135" in unit.content
    assert "--shutdown-timeout" not in unit.content


def test_templates_from_user_directory(tmp_path: Path, plan_one: Plan) -> None:
    for name in ("vllm.service.j2", "vllm.env.j2"):
        shutil.copy(templates_dir() / name, tmp_path / name)
    (tmp_path / "vllm.service.j2").write_text("# custom {{ unit }}\n" + (tmp_path / "vllm.service.j2").read_text())
    (unit, _) = render_host(plan_one(**A10), environment_for_templates(templates_dir(tmp_path)))
    assert unit.content.startswith("# custom ernie-vllm-0\n")
    (tmp_path / "vllm.service.j2").write_text("{{ no_such_value }}")
    with pytest.raises(RenderError, match="no_such_value"):
        render_host(plan_one(**A10), environment_for_templates(tmp_path))
    (tmp_path / "vllm.env.j2").unlink()
    with pytest.raises(RenderError, match=r"lacks vllm\.env\.j2"):
        templates_dir(tmp_path)


def test_packaged_templates_are_the_source_templates() -> None:
    for name in ("vllm.service.j2", "vllm.env.j2"):
        assert (templates_dir() / name).read_text() == (ROOT / "templates" / name).read_text()


def test_plan_with_errors_renders_nothing(plan_one: Plan) -> None:
    with pytest.raises(RenderError, match="the plan has errors"):
        render_host(plan_one(**A10, vllm_tensor_parallel_size=3), ENV)


needs_systemd_analyze = needs_program("systemd-analyze", "systemd")


@needs_systemd_analyze
def test_every_rendered_unit_passes_systemd_analyze_verify(tmp_path: Path, plan_one: Plan) -> None:
    # verify checks that ExecStart's binary exists and is executable, so point the plan at a real file.
    vllm = tmp_path / "bin" / "vllm"
    vllm.parent.mkdir()
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    plans = [*example_plans(),
             plan_one(**A10, vllm_extra_args=["--enforce-eager", "--generation-config", "a b%c$d\"e'f\\g"]),
             plan_one(gpu_model="A10", gpu_count=4, vllm_instances=2, vllm_tensor_parallel_size=2),
             plan_one(**A10, vllm_env=HOSTILE_ENV, vllm_served_model_name="m%h")]
    units = []
    for plan in plans:
        for f in render_host(plan, ENV):
            if f.path.endswith(".service"):
                path = tmp_path / plan.name / Path(f.path).name
                path.parent.mkdir(exist_ok=True)
                path.write_text(f.content.replace("/opt/vllm/0.34.0/bin/vllm", str(vllm)))
                units.append(path)
    for unit in units:
        result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0 and result.stderr == "", f"{unit}: {result.stderr}"


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_any_word_survives_systemd_parsing_or_is_rejected(value: str) -> None:
    try:
        word = systemd_word(value, "x", "h")
    except RenderError as exc:
        assert re.search(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", value), f"rejected harmless {value!r}: {exc}"
        return
    assert "\n" not in word
    assert unsystemd(word) == [value]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=4), st.text(min_size=1, max_size=20))
def test_hostile_args_and_names_render_safely_or_fail_clearly(args: list[str], name: str) -> None:
    from ernie_deploy.planning.plan import plan_host

    class H:
        address = "h"

        def __init__(self, v: dict) -> None:
            self.vars, self.name = v, "h"

    plan = plan_host(H({**A10, "vllm_extra_args": [f"--x={a}" for a in args],
                        "vllm_served_model_name": name}), PlanContext.load())
    try:
        unit, _ = render_host(plan, ENV)
    except RenderError as exc:
        assert exc.where == "h"
        return
    lines = unit.content.splitlines()
    exec_line = next(line for line in lines if line.startswith("ExecStart="))
    argv = unsystemd(exec_line.removeprefix("ExecStart="))
    assert argv[argv.index("--served-model-name") + 1] == name
    assert argv[-len(args):] == [f"--x={a}" for a in args]
    assert sum(1 for line in lines if line.startswith("ExecStart=")) == 1


@pytest.mark.parametrize(("var", "value", "message"), [
    ("vllm_served_model_name", "evil\nExecStartPre=/bin/rm -rf /", "control character"),
    ("vllm_extra_args", ["--x", "a\rb"], "control character"),
    ("vllm_bin", "/opt/vllm/bin/vllm; rm -rf /", "vllm_bin must be an absolute path"),
    ("vllm_bin", "vllm", "vllm_bin must be an absolute path"),
    ("vllm_user", "root\nUser=x", "not a valid user name"),
    ("vllm_model", "--trust-remote-code/ERNIE-4.5-0.3B-PT", "must not be empty or start with '-'"),
    ("vllm_host", "0.0.0.0 --api-key x", "vllm_host must be an address"),
    ("vllm_env", {"BAD KEY": "x"}, "environment variable name"),
    ("vllm_env", {"CUDA_VISIBLE_DEVICES": "7"}, "must not set CUDA_VISIBLE_DEVICES"),
    ("vllm_env", {"VLLM_API_KEY": "x"}, "must not set VLLM_API_KEY"),
    ("vllm_env", {"VLLM_CPU_KVCACHE_SPACE": "4"}, "must not set VLLM_CPU_KVCACHE_SPACE"),
    ("vllm_env", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "must not set VLLM_CPU_OMP_THREADS_BIND"),
    ("vllm_api_key", "ab'c", "quote or backslash"),
    ("hf_token", "a\nb", "control character"),
])
def test_hostile_values_are_rejected_clearly(plan_one: Plan, var: str, value: object, message: str) -> None:
    p = plan_one(**A10, **{var: value})
    with pytest.raises(RenderError, match=message) as err:
        render_host(p, ENV)
    assert err.value.where == "h"
    assert "ab'c" not in str(err.value) and "a\nb" not in str(err.value)  # secrets never echoed


def test_specifiers_and_dollars_are_escaped(plan_one: Plan) -> None:
    (unit, _) = render_host(plan_one(**A10, vllm_served_model_name="m%h$HOME", vllm_env={"A": "x y"}), ENV)
    assert "--served-model-name m%%h$$HOME" in unit.content
    assert 'Environment="A=x y"' in unit.content


# Values an operator may well put in vllm_env, each a way an escape can go wrong (issue 23, item 5).
HOSTILE_ENV = {
    "SINGLE": "it's", "DOUBLE": 'say "hi"', "DOLLAR": "$HOME ${HOME} $$", "SUBST": "$(id)`id`",
    "PERCENT": "100%h %% %i", "BACKSLASH": "a\\b\\\\c\\n\\$x", "SPACES": "  two  spaces  ", "HASH": "#not a comment",
    "MIXED": "'\"$%\\ #;",
}


def test_env_values_arrive_byte_for_byte(plan_one: Plan) -> None:
    (unit, _) = render_host(plan_one(**A10, vllm_env=HOSTILE_ENV), ENV)
    seen: dict[str, str] = {}
    for line in unit.content.splitlines():
        if line.startswith("Environment="):
            seen.update(unsystemd_environment(line.removeprefix("Environment=")))
    assert {k: seen[k] for k in HOSTILE_ENV} == HOSTILE_ENV


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=30))
def test_any_env_value_survives_environment_parsing_or_is_rejected(value: str) -> None:
    from ernie_deploy.planning.render import environment_word

    try:
        word = environment_word(f"K={value}", "x", "h")
    except RenderError:
        assert re.search(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", value)
        return
    assert unsystemd_environment(word) == {"K": value}


def test_specifiers_in_names_arrive_literally(plan_one: Plan) -> None:
    (unit, _) = render_host(plan_one(**A10, vllm_served_model_name="m%h-%i"), ENV)
    assert "Description=vLLM serving m%%h-%%i on port 8000 (ernie-deploy ernie-vllm-0)" in unit.content
    for line in unit.content.splitlines():
        if not line.startswith("#"):
            assert not re.search(r"%[^%]", line.replace("%%", "")), f"specifier left in {line!r}"


def test_render_files_have_modes_on_disk(tmp_path: Path) -> None:
    from ernie_deploy.cli.main import main

    out = tmp_path / "out"
    rc = main(["render", "-i", str(ROOT / "inventory/example.yml"), "-o", str(out)])
    assert rc == 1  # gpu-a10-05.dc1 has TP 3
    assert not (out / "gpu-a10-05.dc1").exists()
    env = out / "gpu-a10-01.dc1/etc/ernie-deploy/ernie-vllm-0.env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert (out / "gpu-a10-01.dc1/etc/systemd/system/ernie-vllm-0.service").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging leftovers


@pytest.mark.parametrize(("var", "value", "message"), [
    ("vllm_served_model_name", "evil\nExecStartPre=/bin/rm -rf /", "control character"),
    ("vllm_model", "--trust-remote-code/ERNIE-4.5-0.3B-PT", "must not be empty or start with '-'"),
    ("vllm_bin", "vllm", "vllm_bin must be an absolute path"),
    ("vllm_user", "root\nUser=x", "not a valid user name"),
    ("vllm_env", {"CUDA_VISIBLE_DEVICES": "7"}, "must not set CUDA_VISIBLE_DEVICES"),
    ("vllm_env", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "must not set VLLM_CPU_OMP_THREADS_BIND"),
    ("hf_token", "a\nb", "control character"),
])
def test_plan_refuses_what_render_refuses(plan_one: Plan, var: str, value: object, message: str) -> None:
    """One validation: the value render would refuse is already an error of the plan, with the same text."""
    p = plan_one(**A10, **{var: value})
    assert not p.ok
    (finding,) = [f for f in p.errors if f.code == "unsafe-value"]
    assert re.search(message, finding.message)


@pytest.mark.parametrize("var", ["hf_token", "vllm_api_key"])
def test_secret_values_never_reach_a_message(plan_one: Plan, var: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_deploy.cli.main import main

    secret = "hf_abcSECRET\nX"
    p = plan_one(**A10, **{var: secret})
    texts = [f.message + (f.fix or "") for f in p.findings]
    with pytest.raises(RenderError) as err:
        render_host(p, ENV)
    texts.append(str(err.value))
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"h": {**A10, var: secret}}}}))
    for command in (["plan", "--json"], ["render", "-o", str(tmp_path / "out"), "--json"], ["plan"]):
        main([command[0], "-i", str(inv), *command[1:]])
        captured = capsys.readouterr()
        texts += [captured.out, captured.err]
    assert not [t for t in texts if "SECRET" in t or "hf_abc" in t]


def test_cpu_backend_variables_become_environment_lines(plan_one: Plan) -> None:
    """docs/variables.md#vllms-cpu-backend: beside vllm_env's lines; `|` makes systemd need quotes."""
    p = plan_one(**A10, vllm_version="0.32.0+cpu", vllm_cpu_kvcache_space=1, vllm_cpu_omp_threads_bind="0|1",
                 vllm_env={"HF_HUB_OFFLINE": "1"})
    unit, _ = render_host(p, ENV)
    env_lines = [line for line in unit.content.splitlines() if line.startswith("Environment")]
    assert env_lines == ["Environment=CUDA_VISIBLE_DEVICES=0,1", "Environment=VLLM_NO_USAGE_STATS=1",
                         "Environment=PYTHONUNBUFFERED=1", "Environment=VLLM_CPU_KVCACHE_SPACE=1",
                         'Environment="VLLM_CPU_OMP_THREADS_BIND=0|1"', "Environment=HF_HUB_OFFLINE=1",
                         "EnvironmentFile=/etc/ernie-deploy/ernie-vllm-0.env"]
    assert unsystemd('"VLLM_CPU_OMP_THREADS_BIND=0|1"') == ["VLLM_CPU_OMP_THREADS_BIND=0|1"]
    assert "ExecStart=/opt/vllm/0.32.0+cpu/bin/vllm serve " in unit.content
    assert "--shutdown-timeout 30" in unit.content  # 0.32 has it (docs/vllm-facts.md#vllm-032-and-the-cpu-backend)


def test_each_instance_gets_its_own_binding_and_unset_ones_render_nothing(plan_one: Plan) -> None:
    p = plan_one(gpu_model="NVIDIA A10", gpu_count=4, vllm_tensor_parallel_size=2, vllm_instances=2,
                 vllm_version="0.32.0+cpu", vllm_cpu_kvcache_space=2, vllm_cpu_omp_threads_bind=["0|1", "2|3"])
    units = [f for f in render_host(p, ENV) if f.path.endswith(".service")]
    assert ['Environment="VLLM_CPU_OMP_THREADS_BIND=0|1"' in u.content for u in units] == [True, False]
    assert ['Environment="VLLM_CPU_OMP_THREADS_BIND=2|3"' in u.content for u in units] == [False, True]
    assert all("Environment=VLLM_CPU_KVCACHE_SPACE=2" in u.content for u in units)
    (plain, _) = render_host(plan_one(**A10), ENV)
    assert "VLLM_CPU_" not in plain.content


@pytest.mark.parametrize("command", ["render", "export", "deploy"])
def test_a_broken_user_template_is_one_error_with_file_and_line_and_exit_5(
        tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a traceback: the template is compiled before any host is planned, rendered or contacted."""
    from ernie_deploy.cli.main import main
    for name in ("vllm.service.j2", "vllm.env.j2"):
        shutil.copy(templates_dir() / name, tmp_path / name)
    broken = tmp_path / "vllm.service.j2"
    lines = broken.read_text().splitlines()
    broken.write_text("\n".join([*lines[:3], "{{ 1 + }}", *lines[3:]]) + "\n")
    inv = tmp_path / "inv.yml"
    inv.write_text("a:\n  hosts:\n    h1: {ansible_host: 127.0.0.1, gpu_model: NVIDIA A10, gpu_count: 1}\n")
    argv = {"render": ["render", "-o", str(tmp_path / "out")], "export": ["export", "ansible", "-o",
                                                                          str(tmp_path / "x")],
            "deploy": ["deploy"]}[command]
    assert main([*argv, "-i", str(inv), "--templates", str(tmp_path)]) == 5
    err = capsys.readouterr().err
    assert f"{broken}:4" in err and "template syntax error" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()
