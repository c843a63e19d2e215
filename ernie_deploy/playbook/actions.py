"""The playbook actions, each declared once: its arguments (type, default, help), whether it changes hosts and
whether it runs under `--check`. The checker (schema.py), `run --help`, the check-mode skip and the runner's
argument defaults read this table; the runner binds each name to its handler (orchestration/playrun.py, a test
keeps the two the same). Free of the checker's imports so `run --help` names the actions without loading it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NUMBER = (int, float)
STRINGS = "list of strings"


@dataclass(frozen=True)
class Arg:
    kind: type | tuple[type, ...] | str  # a type, types, or STRINGS
    help: str
    default: Any = None  # what the runner uses when the task leaves it out
    required: bool = False


@dataclass(frozen=True)
class Action:
    args: Mapping[str, Arg] = field(default_factory=dict)
    changes_hosts: bool = False  # `--check` reports what it would do instead of doing it
    runs_in_check: bool = True  # False: skipped under `--check` (it cannot say what it would do without doing it)


_ROLL = {
    "always": Arg(bool, "restart every instance in scope, not only those whose files changed or are not serving",
                  False),
    "instance": Arg((int, str), "only this instance of each host: its index or unit name"),
    "pre_drain": Arg(str, "controller command before an instance is stopped (take it out of the balancer)"),
    "post_ready": Arg(str, "controller command after an instance passed the readiness gate (put it back)"),
    "hook_timeout": Arg(NUMBER, "longest a hook may run, seconds", 60.0),
    "idle_timeout": Arg(NUMBER, "seconds to wait for in-flight requests to reach 0", 60.0),
    "gpu_release_timeout": Arg(NUMBER, "seconds to wait for an instance's GPUs to be free", 120.0),
    "startup_budget": Arg(NUMBER, "seconds a started instance may take to be ready (0: vllm_startup_budget)", 0.0),
    "parallel_instances": Arg(bool, "restart a host's instances at once instead of one at a time", False),
    "rollback": Arg(bool, "restore what ran before on a failed instance", True),
    "force": Arg(bool, "start although instances in scope are already down", False),
    "slo_gate": Arg(bool, "bench the canary batch against the hosts' SLOs (vllm_slo_*) after its checks; a miss fails "
                          "it like a failed start", True),
}
# A watch's bounds (the `watch` command and task): how long it may run in all, and the shortest pause between
# the starts of two rounds (each round reads every instance's /metrics twice, a progress window apart).
WATCH_MAX_SECONDS = 86400.0
WATCH_MIN_EVERY = 1.0


def watch_problem(seconds: float, every: float) -> tuple[str, str, str] | None:
    """Why a watch's `for` / `every` are out of bounds, as (which of the two, what is wrong, the fix); None when
    they are fine."""
    if not 0 < seconds <= WATCH_MAX_SECONDS:
        return ("for", f"must be above 0 and at most {WATCH_MAX_SECONDS:g} seconds, got {seconds:g}",
                "watch for the seconds you mean, e.g. 60 (a day at most: run it again, or from a timer, for longer)")
    if not WATCH_MIN_EVERY <= every <= WATCH_MAX_SECONDS:
        return ("every", f"must be at least {WATCH_MIN_EVERY:g} and at most {WATCH_MAX_SECONDS:g} seconds, got "
                f"{every:g}", "start a round every few seconds, e.g. 10")
    return None


# A bench task's `workload:` and `slo:` keys: the vllm_bench_* and vllm_slo_* variables without their prefix.
BENCH_PARTS = {"workload": "bench_", "slo": "slo_"}

# In the order the docs list them (docs/playbooks.md says what each does).
ACTIONS: dict[str, Action] = {
    "provision": Action({"verify_files": Arg(bool, "re-hash the model files on the host", False),
                         "bwlimit": Arg(str, "copy rate limit, e.g. 50M")}, changes_hosts=True),
    "plan": Action(),
    "converge": Action({"prune": Arg(bool, "also remove units of instances no longer in the plan", False)},
                       changes_hosts=True),
    "rolling": Action(_ROLL, changes_hosts=True),
    "restart": Action(_ROLL, changes_hosts=True),
    "wait_ready": Action({"timeout": Arg(NUMBER, "seconds to wait for every instance to serve", 600.0)},
                         runs_in_check=False),
    "verify": Action({"expect": Arg(STRINGS, "log patterns that must appear in the start-up log", ()),
                      "forbid": Arg(STRINGS, "log patterns that must not appear", ()),
                      "stream": Arg(bool, "ask for the smoke completion as a stream", False)}),
    "gpu_check": Action(),
    "bench": Action({"workload": Arg(dict, "workload overrides: input_len, output_len, num_prompts, request_rate, "
                                           "max_concurrency, timeout, seed", {}),
                     "slo": Arg(dict, "SLO overrides: ttft_p99_ms, tpot_p99_ms, itl_p99_ms, min_output_throughput, "
                                      "min_goodput", {}),
                     "gate": Arg(bool, "an SLO missed fails the task (false: the verdicts are warnings)", True),
                     "instance": Arg((int, str), "only this instance of each host: its index or unit name")},
                    runs_in_check=False),
    "watch": Action({"for": Arg(NUMBER, "seconds to keep watching (at most a day)", 60.0),
                     "every": Arg(NUMBER, "seconds between the starts of two rounds (at least 1)", 10.0),
                     "restart_stalled": Arg(bool, "restart a stalled or stuck instance through the restart cycle, "
                                                  "one at a time, never the last serving one of its model", False)},
                    changes_hosts=True, runs_in_check=False),
    "hook": Action({"run": Arg(str, "the command, run with /bin/sh -c on the controller", required=True),
                    "timeout": Arg(NUMBER, "seconds before it is killed", 60.0),
                    "once": Arg(bool, "run once for the play instead of once per host", False)},
                   runs_in_check=False),
    "pause": Action({"seconds": Arg(NUMBER, "wait this long"),
                     "prompt": Arg(str, "wait until the operator presses Enter (refused without a terminal)")},
                    runs_in_check=False),
    "command": Action({"run": Arg(str, "the command, run with /bin/sh -c on each host as root", required=True),
                       "timeout": Arg(NUMBER, "seconds before it counts as failed", 600.0)},
                      changes_hosts=True, runs_in_check=False),
}
