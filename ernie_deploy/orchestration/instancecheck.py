"""Every check of one running instance, from what one probe command and the HTTP answers returned."""

from __future__ import annotations

from ernie_deploy.checks import http as judge
from ernie_deploy.checks.gpus import check_gpus
from ernie_deploy.checks.logscan import check_startup_log
from ernie_deploy.checks.playbook import Expectations
from ernie_deploy.checks.result import CheckInputError, CheckResult
from ernie_deploy.checks.signatures import instance_context
from ernie_deploy.orchestration import httpprobe
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.remote.probe import UnitState, descendants


def address_of(plan: HostPlan, inst: InstancePlan) -> str:
    return plan.address if inst.host in ("0.0.0.0", "::") else inst.host


def api_key(plan: HostPlan) -> str | None:
    secret = plan.secrets.get("VLLM_API_KEY")
    return secret.reveal() if secret is not None else None


def systemd_check(inst: InstancePlan, state: UnitState) -> CheckResult:
    name = "systemd"
    if state.restarts >= 2:
        return CheckResult(name, "fail", f"{inst.unit}.service is in a crash loop: systemd restarted it "
                           f"{state.restarts} times (now {state.active}/{state.sub})", tuple(state.journal[-15:]),
                           cause="the service keeps dying after it starts; Restart=on-failure keeps reviving it",
                           fix=f"journalctl -u {inst.unit} shows each attempt; fix the cause, then deploy",
                           instance=inst.unit)
    if state.active == "active" and state.sub == "running":
        summary = f"{inst.unit}.service active (running), pid {state.main_pid}"
        if state.restarts:
            return CheckResult(name, "warn", summary + f", but restarted {state.restarts} time(s) by systemd",
                               cause="the service crashed and Restart=on-failure brought it back",
                               fix=f"journalctl -u {inst.unit} to see why it died", instance=inst.unit)
        return CheckResult(name, "pass", summary, instance=inst.unit)
    return CheckResult(name, "fail", f"{inst.unit}.service is {state.active or 'unknown'} ({state.sub}, "
                       f"result {state.result or '-'}, {state.restarts} restart(s))",
                       tuple(state.journal[-15:]), cause="the service is not running",
                       fix=f"journalctl -u {inst.unit}; then `ernie-deploy deploy` to start it", instance=inst.unit)


def http_checks(plan: HostPlan, inst: InstancePlan, exp: Expectations) -> list[CheckResult]:
    address, key = address_of(plan, inst), api_key(plan)
    state, answer = httpprobe.health(address, inst.port)
    if state != "ready":
        return [CheckResult("http_health", "fail", f"/health on {address}:{inst.port}: {state} "
                            f"({answer.status or answer.error})", instance=inst.unit,
                            fix="wait for loading to finish, or read the journal for why the engine died")]
    out = [CheckResult("http_health", "pass", f"/health 200 on {address}:{inst.port}", instance=inst.unit)]
    models = httpprobe.models(address, inst.port, key)
    out.append(judge.judge_models(models.body, inst.served_model_name, inst.max_model_len, instance=inst.unit)
               if models.status == 200 else
               CheckResult("http_models", "fail", f"/v1/models answered {models.status or models.error}",
                           fix="set vllm_api_key if the server requires one" if models.status == 401 else None,
                           instance=inst.unit))
    done = httpprobe.completion(address, inst.port, inst.served_model_name, key, exp.stream)
    result = judge.judge_completion(done.status or 0, done.body, inst.served_model_name, instance=inst.unit)
    timing = f" (first byte {done.first_byte_seconds * 1000:.0f} ms, total {done.seconds * 1000:.0f} ms)" \
        if done.first_byte_seconds is not None else ""
    out.append(CheckResult(result.name, result.status, result.summary + timing, result.evidence, result.cause,
                           result.fix, result.instance))
    return out


def instance_checks(plan: HostPlan, inst: InstancePlan, state: UnitState, gpus_text: str, apps_text: str,
                    ps_text: str, exp: Expectations) -> list[CheckResult]:
    results = [systemd_check(inst, state)]
    values = instance_context(inst, plan.model.num_attention_heads if plan.model else None)
    results += check_startup_log(
        state.journal, tp=inst.tensor_parallel_size, max_model_len=inst.max_model_len,
        kv_tokens_estimate=inst.memory.kv_tokens if inst.memory else None, expect=exp.expect, forbid=exp.forbid,
        values=values, context=values, instance=inst.unit)
    if state.active == "active":
        results += http_checks(plan, inst, exp)
    try:
        results += check_gpus(gpus_text, apps_text, instance_gpus=inst.gpus,
                              instance_pids=descendants(ps_text, state.main_pid), instance=inst.unit)
    except CheckInputError as exc:
        results.append(CheckResult("gpus", "fail", f"nvidia-smi output unusable: {exc.message}", instance=inst.unit))
    return results
