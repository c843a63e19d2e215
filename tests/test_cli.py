"""The command line as users and scripts see it: output, JSON, exit codes, errors that name the place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from ernie_deploy.cli.main import main

EXAMPLE = str(ROOT / "inventory/example.yml")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_is_versioned_and_complete(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "plan", "-i", EXAMPLE, "--json")
    assert rc == 1  # the example's deliberate TP 3 host
    data = json.loads(out)
    assert data["schema"] == "ernie-deploy/plan/v2" and data["ok"] is False
    hosts = {h["host"]: h for h in data["hosts"]}
    assert len(hosts) == 6
    bad = hosts["gpu-a10-05.dc1"]
    assert not bad["ok"]
    assert bad["findings"][0]["vllm_message"] == (
        "Total number of attention heads (16) must be divisible by tensor parallel size (3).")
    inst = hosts["gpu-a10-04.dc1"]["instances"][0]
    assert (inst["tensor_parallel_size"], inst["max_model_len"], inst["gpus"]) == (4, 8192, [0, 1, 2, 3])
    assert inst["memory"]["kv_bytes_per_token_per_gpu"] == 9216


def test_plan_limit_selects_hosts_and_exit_zero_when_clean(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "plan", "-i", EXAMPLE, "--limit", "a10:!gpu-a10-05.dc1", "--json")
    assert rc == 0
    assert {h["host"] for h in json.loads(out)["hosts"]} == {
        "gpu-a10-01.dc1", "gpu-a10-02.dc1", "gpu-a10-03.dc1", "gpu-a10-04.dc1"}


def test_plan_human_output_names_error_and_fix(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "plan", "-i", EXAMPLE, "--limit", "gpu-a10-05.dc1")
    assert rc == 1
    assert "Total number of attention heads (16) must be divisible by tensor parallel size (3)." in out
    assert "fix: set vllm_tensor_parallel_size to 4" in out
    assert "1 host(s), 1 with errors: gpu-a10-05.dc1" in out


def test_explain_shows_sources(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "explain", "-i", EXAMPLE, "gpu-a10-05.dc1", "--json")
    assert rc == 1
    settings = json.loads(out)["settings"]
    assert settings["tensor_parallel_size"] == {"value": 3, "source": "inventory variable",
                                                "where": f"{EXAMPLE}, host gpu-a10-05.dc1"}
    assert settings["max_model_len"] == {"value": 8192, "source": "row 4xA10"}
    rc, out, _ = run(capsys, "explain", "-i", EXAMPLE, "gpu-a10-04.dc1")
    assert rc == 0 and "--tensor-parallel-size" in out and "tensor_parallel_size: row 4xA10" in out


def test_explain_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "explain", "-i", EXAMPLE, "nope")
    assert rc == 5 and "no host 'nope' in the inventory" in err


def test_secrets_never_in_plan_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    h: {gpu_model: A10, gpu_count: 1, vllm_api_key: sk-topsecret, "
                   "hf_token: hf_secret}\n")
    for args in (("plan", "-i", str(inv), "--json"), ("explain", "-i", str(inv), "h"),
                 ("explain", "-i", str(inv), "h", "--json")):
        _, out, err = run(capsys, *args)
        assert "sk-topsecret" not in out + err and "hf_secret" not in out + err
    _, out, _ = run(capsys, "explain", "-i", str(inv), "h", "--json")
    assert json.loads(out)["settings"]["api_key"]["value"] == "[REDACTED]"


def test_malformed_inventory_names_file_and_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    h: {gpu_model: A10\n  vars: [\n")
    rc, out, err = run(capsys, "plan", "-i", str(inv))
    assert rc == 5 and out == ""
    assert str(inv) in err and ":" in err.split(str(inv))[1][:3]


def test_bad_table_is_input_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    table = tmp_path / "t.yml"
    table.write_text("rows: {}\n")
    rc, _, err = run(capsys, "plan", "-i", EXAMPLE, "--table", str(table))
    assert rc == 5 and "rows: expected list" in err


def test_render_json_and_no_partial_host(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = run(capsys, "render", "-i", EXAMPLE, "-o", str(tmp_path), "--json")
    data = json.loads(out)
    assert rc == 1 and list(data["failed"]) == ["gpu-a10-05.dc1"]
    assert len(data["written"]) == 10  # 5 good hosts × (unit + env file)
    # Rendering again replaces each host's directory whole.
    rc2, _, _ = run(capsys, "render", "-i", EXAMPLE, "-o", str(tmp_path), "--limit", "gpu-a10-01.dc1")
    assert rc2 == 0 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["gpu-a10-01.dc1", "gpu-a10-02.dc1", "gpu-a10-03.dc1", "gpu-a10-04.dc1", "gpu-a100-01.dc1"])


def test_inventory_list_matches_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "inventory", "-i", EXAMPLE, "--list")
    data = json.loads(out)
    assert rc == 0 and "_meta" in data and "gpu-a10-05.dc1" in data["_meta"]["hostvars"]
    assert data["_meta"]["hostvars"]["gpu-a10-05.dc1"]["vllm_tensor_parallel_size"] == 3
    rc, out, _ = run(capsys, "inventory", "-i", EXAMPLE, "--graph")
    assert rc == 0 and out.startswith("@all:")


def test_module_entry_point_and_help() -> None:
    result = subprocess.run([sys.executable, "-m", "ernie_deploy", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    for command in ("plan", "render", "explain", "inventory", "lab"):
        assert command in result.stdout
    assert "Exit codes" in result.stdout


def test_diffs_are_never_wrapped(capsys: pytest.CaptureFixture[str]) -> None:
    """A diff line longer than the console must stay one line: a wrapped tail would read as another line."""
    from ernie_deploy.orchestration.details import Change
    from ernie_deploy.orchestration.results import HostResult, Status
    from ernie_deploy.output.recap import show_results

    long = "+ExecStart=/opt/vllm/bin/vllm serve /models/ERNIE-4.5-0.3B-PT " + "--x " * 80
    diff = f"--- a (on host)\n+++ a (planned)\n@@ -1 +1 @@\n-old\n{long}\n"
    show_results([HostResult("h", Status.CHANGED, "would change", detail=Change(diffs=[diff]))])
    out = capsys.readouterr().out
    assert long in out.splitlines()


def test_verify_json_has_its_own_schema(capsys: pytest.CaptureFixture[str]) -> None:
    """verify's document is not deploy's (issue 23, item 13): its own name, in --help too."""
    from ernie_deploy.checks.result import CheckResult
    from ernie_deploy.orchestration.results import HostResult
    from ernie_deploy.output.remote import show_verify
    show_verify([HostResult("h", checks=[CheckResult("systemd", "pass", "up", instance="vllm-0")])], 0, json=True,
                verbose=0)
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "ernie-deploy/verify/v2" and data["hosts"][0]["checks"][0]["name"] == "systemd"
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "deploy/verify/v2" in capsys.readouterr().out  # argparse may wrap after "ernie-"


def test_host_level_checks_print_under_their_host_not_none(capsys: pytest.CaptureFixture[str]) -> None:
    """A check of the host as a whole (a drop-in) has no instance: it prints under the host (issue 23, item 13)."""
    from ernie_deploy.checks.result import CheckResult
    from ernie_deploy.orchestration.results import HostResult, Status
    from ernie_deploy.output.recap import show_checks, show_results
    result = HostResult("gpu-1", Status.FAILED, checks=[
        CheckResult("systemd", "pass", "up", instance="vllm-0"),
        CheckResult("drop-in", "fail", "/etc/x.conf overrides a managed unit", fix="fold it in")])
    show_checks([result], verbose=1)
    show_results([result], verbose=1)
    out = capsys.readouterr().out
    assert "None" not in out
    assert "  vllm-0\n" in out and "  host gpu-1\n" in out and "fail host gpu-1 drop-in" in out


PARAMIKO_TRACEBACK = """
import logging, sys
from ernie_deploy.cli import main as cli


def plan(args):
    try:
        raise EOFError("banner")
    except EOFError:
        logging.getLogger("paramiko.transport").error("Exception (client): error reading SSH banner", exc_info=True)
    return 0


cli.cmd_plan = plan
sys.exit(cli.main(sys.argv[1:]))
"""


def test_paramikos_tracebacks_reach_stderr_only_with_vvv() -> None:
    """paramiko logs a failed connection with its traceback at ERROR; the host's result names the failure, so
    the traceback is -vvv detail (issue 23, item 13)."""
    def stderr(*extra: str) -> str:
        return subprocess.run([sys.executable, "-c", PARAMIKO_TRACEBACK, *extra, "plan", "-i", EXAMPLE],
                              capture_output=True, text=True, check=True).stderr
    assert stderr() == ""
    assert "Traceback" in stderr("-vvv") and "EOFError: banner" in stderr("-vvv")


def test_findings_print_once_per_run_and_advice_only_with_v(capsys: pytest.CaptureFixture[str]) -> None:
    """A playbook's tasks all carry a host's plan findings: a warning prints once per run, advice is -v detail
    (issue 23, item 13)."""
    from ernie_deploy.orchestration.results import HostResult, Status
    from ernie_deploy.output.recap import show_results
    from ernie_deploy.planning.findings import Finding, Severity
    findings = [Finding(Severity.WARNING, "flag-unknown", "--x not known for vLLM 0.1"),
                Finding(Severity.ADVICE, "replicas", "2 replicas would fit")]
    shown: set[tuple[str, str]] = set()
    for _ in range(3):  # three tasks
        show_results([HostResult("h", Status.OK, "ok", findings=list(findings))], 0, shown)
    out = capsys.readouterr().out
    assert out.count("--x not known") == 1 and "2 replicas" not in out
    show_results([HostResult("h", Status.OK, "ok", findings=list(findings))], 1)
    assert "2 replicas would fit" in capsys.readouterr().out
