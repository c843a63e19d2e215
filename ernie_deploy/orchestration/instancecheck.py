"""Every check of one running instance, from what one probe command returned (systemd, this invocation's
journal, nvidia-smi, the process tree, and the HTTP answers the host itself got)."""

from __future__ import annotations

from ernie_deploy.checks import http as judge
from ernie_deploy.checks.deaths import Story
from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.checks.gpus import check_gpus
from ernie_deploy.checks.logscan import check_startup_log
from ernie_deploy.checks.result import CheckInputError, CheckResult
from ernie_deploy.checks.signatures import instance_context
from ernie_deploy.planning.hostpaths import local_url
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.remote import http
from ernie_deploy.remote.probe import HostProbe, UnitProbe, descendants
from ernie_deploy.remote.systemd import UnitState, restarted_recently, up_seconds


def api_key(plan: HostPlan) -> str | None:
    secret = plan.secrets.get("VLLM_API_KEY")
    return secret.reveal() if secret is not None else None


def request_id(inst: InstancePlan, what: str) -> str:
    return f"{inst.unit} {what}"


def requests_for(plan: HostPlan, inst: InstancePlan, exp: Expectations, *, serving: bool = True) -> list[http.Request]:
    """/health, then (only when it answered 200) /v1/models and one small deterministic completion."""
    base = local_url(inst.host, inst.port)  # as seen from its own host: a wildcard bind means loopback
    health = http.Request(request_id(inst, "health"), f"{base}/health", timeout=5)
    if not serving:
        return [health]
    return [health,
            http.Request(request_id(inst, "models"), f"{base}/v1/models", auth=True, after=health.id),
            http.Request(request_id(inst, "completion"), f"{base}/v1/completions", auth=True, after=health.id,
                         timeout=60, data=judge.completion_request(inst.served_model_name, stream=exp.stream))]


def systemd_check(inst: InstancePlan, state: UnitState, journal: list[str], now_us: int | None,
                  stable_s: float, story: Story | None = None) -> CheckResult:
    """Running, and not restarted by systemd within the stability window (remote/systemd.py says when a
    restart is history); a unit waiting to be revived makes every restart recent. `story`: how its engine last
    died and what followed (checks/deaths.py), told instead of the journal's last lines, which after a death are
    teardown noise."""
    name = "systemd"
    running = state.active_state == "active" and state.sub_state == "running"
    recent = restarted_recently(state, now_us, stable_s)
    up_s = up_seconds(state, now_us)
    evidence = (story.text,) if story else tuple(journal[-15:])
    if state.n_restarts >= 2 and recent:
        return CheckResult(name, "fail", f"{inst.unit}.service is in a crash loop: systemd restarted it "
                           f"{state.n_restarts} times (now {state.active_state}/{state.sub_state})",
                           evidence, cause="the service keeps dying after it starts; Restart=always keeps reviving "
                           "it until its start limit",
                           fix=f"journalctl -u {inst.unit} shows each attempt; fix the cause, then deploy",
                           instance=inst.unit)
    if running:
        summary = f"{inst.unit}.service active (running), pid {state.main_pid}"
        if recent:
            return CheckResult(name, "warn", summary + (f": {story.text}" if story else
                                                        f", but restarted {state.n_restarts} time(s) by systemd "
                                                        f"{up_s or 0:.0f}s ago"),
                               evidence if story else (),
                               cause="the service exited and systemd's Restart=always brought it back",
                               fix=f"journalctl -u {inst.unit} to see why it died", instance=inst.unit)
        if story:
            summary += f"; {story.text}"
        elif state.n_restarts:
            summary += f"; restarted {state.n_restarts} time(s) earlier, up {up_s:.0f}s since"
        return CheckResult(name, "pass", summary, instance=inst.unit)
    what = (f"{inst.unit}.service is {state.active_state or 'unknown'} ({state.sub_state}, result "
            f"{state.result or '-'}, {state.n_restarts} restart(s))")
    return CheckResult(name, "fail", what + (f": {story.text}" if story else ""),
                       evidence, cause="the engine died" if story else "the service is not running",
                       fix=story.fix if story and story.fix else
                       f"journalctl -u {inst.unit}; then `ernie-deploy deploy` to start it", instance=inst.unit)


def timed_out(error: str | None) -> bool:
    """Whether a request's error is its timeout (urllib's socket timeout: "timed out", "The read operation timed
    out"), as opposed to a refused or reset connection."""
    return error is not None and "timed out" in error


def http_checks(plan: HostPlan, inst: InstancePlan, answers: dict[str, http.Answer]) -> list[CheckResult]:
    where = f"{inst.host}:{inst.port}"
    health = http.missing(answers, request_id(inst, "health"))
    state = judge.classify_health(health.status, health.error)
    if state != "ready":
        return [CheckResult("http_health", "fail", f"/health on {where} (asked on the host): {state} "
                            f"({health.status or health.error})", instance=inst.unit,
                            fix="wait for loading to finish, or read the journal for why the engine died")]
    out = [CheckResult("http_health", "pass", f"/health 200 on {where}", instance=inst.unit)]
    models = http.missing(answers, request_id(inst, "models"))
    out.append(judge.judge_models(models.body, inst.served_model_name, inst.max_model_len, instance=inst.unit)
               if models.status == 200 else
               CheckResult("http_models", "fail", f"/v1/models answered {models.status or models.error}",
                           fix="set vllm_api_key if the server requires one" if models.status == 401 else None,
                           instance=inst.unit))
    done = http.missing(answers, request_id(inst, "completion"))
    if done.status is None and timed_out(done.error):
        return [*out, judge.not_generating(done.seconds, instance=inst.unit,
                                           fix=f"restart it: ernie-deploy restart -i INV --limit {plan.name} "
                                               f"--instance {inst.index}")]
    result = judge.judge_completion(done.status or 0, done.body, inst.served_model_name, instance=inst.unit)
    timing = f" (first byte {done.first_byte_seconds * 1000:.0f} ms, total {done.seconds * 1000:.0f} ms)" \
        if done.first_byte_seconds is not None else ""
    out.append(CheckResult(result.name, result.status, result.summary + timing, result.evidence, result.cause,
                           result.fix, result.instance))
    return out


def serves(plan: HostPlan, inst: InstancePlan, answers: dict[str, http.Answer]) -> bool:
    """/v1/models lists the served name with the planned length, and the completion works."""
    models = http.missing(answers, request_id(inst, "models"))
    if models.status != 200 or not judge.judge_models(models.body, inst.served_model_name, inst.max_model_len).ok:
        return False
    done = http.missing(answers, request_id(inst, "completion"))
    return judge.judge_completion(done.status or 0, done.body, inst.served_model_name).ok


def instance_checks(plan: HostPlan, inst: InstancePlan, probe: HostProbe, exp: Expectations,
                    story: Story | None = None) -> list[CheckResult]:
    unit: UnitProbe = probe.unit(f"{inst.unit}.service")
    state = unit.state
    results = [systemd_check(inst, state, unit.journal, probe.now_us, plan.tuning.stable_seconds, story)]
    if state.active_state != "active":
        # Only the current run is judged: the lines of a stopped run say nothing about what serves now.
        return [*results, CheckResult("startup_log", "fail", f"{inst.unit} is not running: no current start-up "
                                      "log to judge", instance=inst.unit, fix="`ernie-deploy deploy` starts it")]
    values = instance_context(inst, plan.model.num_attention_heads if plan.model else None)
    results += check_startup_log(
        unit.journal, tp=inst.tensor_parallel_size, max_model_len=inst.max_model_len,
        kv_tokens_estimate=inst.memory.kv_tokens if inst.memory else None, expect=exp.expect, forbid=exp.forbid,
        values=values, context=values, instance=inst.unit)
    results += http_checks(plan, inst, probe.http)
    try:
        results += check_gpus(probe.gpus, probe.apps, instance_gpus=inst.gpus,
                              instance_pids=descendants(probe.ps, state.main_pid), instance=inst.unit)
    except CheckInputError as exc:
        results.append(CheckResult("gpus", "fail", f"nvidia-smi output unusable: {exc.message}", instance=inst.unit))
    return results
