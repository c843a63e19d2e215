"""The story of an engine death from the unit's journal (checks/deaths.py), the facts' script that reads those lines
(remote/facts.py), and where status, verify and the unit's restart policy tell it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

from ernie_deploy.checks.deaths import HOST_PATTERN, events, last_death, tell
from ernie_deploy.orchestration.instancecheck import systemd_check
from ernie_deploy.remote import converge
from ernie_deploy.remote.facts import HostFacts, deaths_script, parse_facts
from ernie_deploy.remote.protocol import MARK
from ernie_deploy.remote.systemd import UnitState

U = "ernie-vllm-0.service"
# short-unix journal lines as a lab host logs an EngineCore killed under load (real 0.32.0 words; the lines
# between are what grep -E HOST_PATTERN keeps of the rest).
KILLED = [
    "1765100000.000000 real-1 systemd[1]: Started ernie-vllm-0.service - vLLM serving ernie on port 8000.",
    "1765100040.000000 real-1 vllm[700]: INFO:     Application startup complete.",
    "1765100100.100000 real-1 vllm[700]: (APIServer pid=700) WARNING 12-07 10:15:00 [core_client.py:869] "
    "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
    "1765100102.000000 real-1 systemd[1]: ernie-vllm-0.service: Deactivated successfully.",
    "1765100112.200000 real-1 systemd[1]: ernie-vllm-0.service: Scheduled restart job, restart counter is at 1.",
    "1765100112.300000 real-1 systemd[1]: Stopped ernie-vllm-0.service - vLLM serving ernie on port 8000.",
    "1765100112.400000 real-1 systemd[1]: Started ernie-vllm-0.service - vLLM serving ernie on port 8000.",
    "1765100150.100000 real-1 vllm[900]: INFO:     Application startup complete.",
]


def test_a_killed_engine_restarted_by_systemd_is_told_with_its_death_line_and_time_to_serve() -> None:
    death = last_death(KILLED)
    assert death is not None
    assert death.line == "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup"
    assert death.exit is None and death.restarted_at == 1765100112.2 and death.serving_after() == 50.0
    story = tell(death, active=True, sub_state="running", restart_policy="always", deploy="DEPLOY")
    assert story.serving and story.fix is None
    assert story.text == ("engine died at 2025-12-07 09:35:00 UTC ([shutdown] MPClient: engine core exited "
                          "unexpectedly; starting cleanup); the server exited 0; restarted by systemd, serving again "
                          "after 50 s")


def test_a_death_under_an_old_on_failure_unit_says_why_it_stays_down_and_how_to_fix_it() -> None:
    lines = KILLED[:4]
    death = last_death(lines)
    assert death is not None
    story = tell(death, active=False, sub_state="dead", restart_policy="on-failure", deploy="ernie-deploy deploy")
    assert not story.serving
    assert "not restarted: the unit's Restart=on-failure does not restart a clean exit" in story.text
    assert story.fix == "ernie-deploy deploy renders Restart=always and starts it"


def test_a_worker_death_is_named_by_its_first_line_and_a_failed_exit_status_is_quoted() -> None:
    lines = [
        "1765100000.0 h vllm[5]: (EngineCore pid=9) ERROR 12-07 10:00:00 [multiproc_executor.py:404] Worker proc "
        "VllmWorker-1 died unexpectedly (exit code: -9), shutting down executor.",
        "1765100006.0 h vllm[5]: (EngineCore pid=9) ERROR 12-07 10:00:06 [core.py:1759] EngineCore encountered a "
        "fatal error.",
        "1765100011.0 h systemd[1]: ernie-vllm-0.service: Main process exited, code=exited, status=1/FAILURE",
        "1765100011.1 h systemd[1]: ernie-vllm-0.service: Failed with result 'exit-code'.",
    ]
    death = last_death(lines)
    assert death is not None and death.line.startswith("Worker proc VllmWorker-1 died unexpectedly")
    assert death.exit == "code=exited, status=1/FAILURE"
    story = tell(death, active=False, sub_state="auto-restart", restart_policy="always", deploy="D")
    assert "the server exited (code=exited, status=1/FAILURE); systemd restarts it after RestartSec" in story.text


def test_a_crash_loop_that_hit_the_start_limit_counts_its_deaths_and_says_systemd_gave_up() -> None:
    died = KILLED[2]
    lines = [*KILLED[:7], died.replace("1765100100", "1765100200"),
             "1765100212.0 h systemd[1]: ernie-vllm-0.service: Start request repeated too quickly.",
             "1765100212.1 h systemd[1]: ernie-vllm-0.service: Failed with result 'start-limit-hit'."]
    death = last_death(lines)
    assert death is not None and death.deaths == 2 and death.gave_up
    story = tell(death, active=False, sub_state="failed", restart_policy="always", deploy="DEPLOY")
    assert story.text.startswith("engine died 2 times; the last at 2025-12-07 09:36:40 UTC")
    assert "systemd gave up at the unit's start limit (5 starts in 10 minutes)" in story.text
    assert story.fix == "read why it keeps dying in the journal, then DEPLOY"


def test_a_requested_stop_or_start_ends_the_story_so_an_old_death_is_not_told_again() -> None:
    stop = "1765100300.0 h systemd[1]: Stopping ernie-vllm-0.service - vLLM serving ernie on port 8000..."
    assert last_death([*KILLED, stop]) is None
    # Dead under an on-failure unit, then started by a deploy: that start was asked for.
    start = "1765100400.0 h systemd[1]: Started ernie-vllm-0.service - vLLM serving ernie on port 8000."
    assert last_death([*KILLED[:4], start]) is None
    # vLLM's own "shutting down" lines during a requested stop are no death.
    assert last_death(["1765100000.0 h vllm[5]: (APIServer pid=5) INFO [launcher.py:1] [shutdown] API server: "
                       "shutdown triggered"]) is None


def test_events_ignore_lines_of_other_shapes_and_other_processes_words() -> None:
    assert events(["garbage", "Dec 07 10:00:00 h vllm[1]: Worker proc VllmWorker-0 died unexpectedly"]) == []
    (ev,) = events(["1765100000.5 h kernel: Out of memory", "1765100001.0 h systemd[1]: ernie-vllm-0.service: A "
                    "process of this unit has been killed by the OOM killer."])
    assert ev.kind == "oom" and ev.at == 1765100001.0


def facts_with(state: UnitState, lines: list[str], now_us: int | None = None) -> HostFacts:
    return HostFacts(units={U: state}, deaths={U: tuple(lines)}, health={U: "200"}, now_us=now_us)


def test_status_names_a_dead_unit_by_its_story_and_a_healed_one_only_while_it_is_recent() -> None:
    dead = UnitState(name=U, active_state="inactive", sub_state="dead", result="success", restart="on-failure")
    problem = converge.serving_problem(U, facts_with(dead, KILLED[:4]), 10)
    assert problem is not None and problem.startswith("not running (inactive/dead): engine died at ")
    assert "Restart=on-failure does not restart a clean exit" in problem
    healed = UnitState(name=U, active_state="active", sub_state="running", main_pid=900, n_restarts=1,
                       started_monotonic=1_000_000, restart="always")
    facts = facts_with(healed, KILLED, now_us=3_000_000)  # up 2 s: within the stability window
    assert "restarted by systemd, serving again after 50 s; up only 2s" in str(converge.serving_problem(U, facts, 10))
    facts = facts_with(healed, KILLED, now_us=100_000_000)
    assert converge.serving_problem(U, facts, 10) is None
    story = converge.death_story(U, facts)
    assert story is not None and story.serving


def test_verify_quotes_the_death_not_the_journals_last_lines() -> None:
    inst = SimpleNamespace(unit="ernie-vllm-0")  # systemd_check reads only the unit's name
    dead = UnitState(name=U, active_state="inactive", sub_state="dead", result="success", restart="on-failure")
    story = converge.death_story(U, facts_with(dead, KILLED[:4]), "DEPLOY")
    noise = ["nanobind: leaked 3 instances!"] * 20
    assert story is not None
    check = systemd_check(inst, dead, noise, None, 10, story)  # type: ignore[arg-type]
    assert check.status == "fail" and "engine died at" in check.summary
    assert check.evidence == (story.text,)
    assert check.fix == "DEPLOY renders Restart=always and starts it"
    assert "nanobind" not in " ".join(check.evidence)


def test_the_facts_script_reads_the_journal_only_of_units_restarted_or_not_running(tmp_path: Path) -> None:
    """The shell part runs here against a fake journalctl that logs its calls."""
    show = tmp_path / "show"
    show.write_text("Id=ernie-vllm-0.service\nActiveState=active\nNRestarts=0\n\n"
                    "Id=ernie-vllm-1.service\nNRestarts=1\nActiveState=active\n\n"
                    "ActiveState=failed\nId=ernie-vllm-2.service\nNRestarts=0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "journalctl").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\nprintf '%s\\n' "
                                        "'1.0 h vllm[1]: noise' '2.0 h systemd[1]: x: Deactivated successfully.' "
                                        "'3.0 h vllm[1]: Worker proc VllmWorker-0 died unexpectedly'\n")
    (bin_dir / "journalctl").chmod(0o755)
    out = subprocess.run(["sh", "-c", deaths_script(str(show))], capture_output=True, text=True, check=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"}).stdout
    assert calls.read_text().split("\n")[:2] == [
        "-u ernie-vllm-1.service -o short-unix --no-pager -n 3000", "-u ernie-vllm-2.service -o short-unix "
        "--no-pager -n 3000"]
    facts = parse_facts(f"{MARK}deaths\n{out}")
    assert set(facts.deaths) == {"ernie-vllm-1.service", "ernie-vllm-2.service"}
    assert facts.deaths["ernie-vllm-1.service"][-1] == "3.0 h vllm[1]: Worker proc VllmWorker-0 died unexpectedly"
    lines = out.splitlines()
    assert lines[0] == "ernie-vllm-1.service 2.0 h systemd[1]: x: Deactivated successfully."
    assert "noise" not in out and len(lines) == 4
    assert HOST_PATTERN in deaths_script("F")


def test_activation_clears_the_start_limit_before_its_own_start() -> None:
    changes = converge.Changes(start=("ernie-vllm-0.service",))
    script = converge.activate_command(changes, {"action": "t"}).intent.render()
    lines = script.splitlines()
    reset = lines.index("systemctl reset-failed ernie-vllm-0.service 2>/dev/null || true")
    assert lines[reset + 1] == "systemctl start ernie-vllm-0.service"


def test_the_clock_is_utc_calendar_time_across_leap_days_and_centuries() -> None:
    import time

    from ernie_deploy.checks.deaths import clock

    for at in (0, 951782400, 951868799.9, 4107542400, 1765100112.2, 1709164800, 32503680000):
        assert clock(at) == time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(at))), at
