"""status's pure parts: the host's process list, the `vllm serve` test, the unit word round trip, logs' split,
the last change as printed."""

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ernie_deploy.orchestration.details import StatusReport
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.output.status import show_status
from ernie_deploy.planning.render import systemd_word, unescape_word
from ernie_deploy.remote import logs
from ernie_deploy.remote.protocol import MARK
from ernie_deploy.remote.status import parse


def _b64(*argv: str) -> str:
    return base64.b64encode(("\x1f".join(argv) + "\x1f").encode()).decode()


def test_processes_are_read_with_their_arguments_and_cgroup() -> None:
    text = (f"{MARK}status-main\nernie-vllm-0.service 42\n{MARK}status-procs\n"
            f"42 {_b64('/opt/vllm/0.34.0/bin/python', '/opt/vllm/0.34.0/bin/vllm', 'serve', '/m', '--port', '8000')} "
            "/system.slice/ernie-vllm-0.service\n"
            f"77 {_b64('sh', '-c', 'grep serve x')} /user.slice/session-3.scope\n"
            f"90 {_b64('vllm', 'serve', 'my model')} /user.slice/session-3.scope\n{MARK}status-end\n")
    seen = parse(text)
    assert seen.main_pids == {"ernie-vllm-0.service": 42}
    assert seen.procs[42].serve_args == ("/m", "--port", "8000") and seen.procs[42].unit == "ernie-vllm-0.service"
    assert seen.procs[77].serve_args is None  # a shell whose script mentions serve is not vLLM
    assert seen.procs[90].serve_args == ("my model",) and seen.procs[90].unit is None


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1))
def test_unescape_inverts_the_unit_files_escaping(value: str) -> None:
    assert unescape_word(systemd_word(value, "x", "h")) == value


def test_logs_split_keeps_the_cursor_apart() -> None:
    text = "invocation abc\n2026-12-04T04:00:00+0000 h vllm[1]: INFO ready\n-- cursor: s=1;i=2\n"
    assert logs.split(text) == ("abc", ["2026-12-04T04:00:00+0000 h vllm[1]: INFO ready"], "s=1;i=2")
    assert logs.split("invocation abc\n-- No entries --\n") == ("abc", [], None)


def test_status_never_prints_none_for_an_audit_line_without_user_or_controller(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Audit lines written before every change carried user and controller (a playbook's command task) still
    read as a last change."""
    last = {"time": "2026-01-05T10:00:00Z", "user": None, "controller": None, "command": "ernie-deploy run (x)",
            "action": "command"}
    show_status([HostResult("a")], {"a": StatusReport(last_change=last)}, 0, json=False)
    out = capsys.readouterr().out
    assert "None" not in out and "last change 2026-01-05T10:00:00Z ? ernie-deploy run (x) (command)" in out
