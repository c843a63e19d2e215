"""A host's snapshot, computed once per host: connect → (lock +) facts → plan → rendered files → changes.

Deploy, verify and (later) rollouts and status start from it; `refresh` re-reads the facts right before a
host is changed, because facts go stale during a long rollout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.fleet import Fleet, HostRun, LockHeld
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.steps import StepStatus
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.plan import HostInputs, PlanContext, build_plan, input_errors, read_inputs
from ernie_deploy.planning.plantypes import Discovered, HostPlan
from ernie_deploy.planning.render import RenderedFile, render_host
from ernie_deploy.remote import converge, lock
from ernie_deploy.remote.command import Intent
from ernie_deploy.remote.facts import HostFacts, gather_command, parse_facts
from ernie_deploy.remote.ssh import Failure, RemoteError


@dataclass
class Snapshot:
    plan: HostPlan
    facts: HostFacts
    files: list[RenderedFile]
    changes: converge.Changes
    taken: float  # time.monotonic() when the facts were read
    text: str = ""  # the gather's whole output (with SnapshotOptions.extra's sections)


@dataclass(frozen=True)
class SnapshotOptions:
    lock: lock.LockInfo | None = None  # None: read-only (check mode, verify): take no lock
    lock_wait: float = 0.0
    prune: bool = False
    render: bool = True
    extra: str = ""  # more script run in the same round trip (read-only runs only); its output is in .text
    # Read the facts without the lock first and take it (re-reading the facts in the same round trip) only when
    # something must change: a run with nothing to change is one command per host. A lock someone else holds
    # is still reported, since the facts show it.
    lock_later: bool = False
    # --resume: a lock left by an earlier run of this user on this controller whose process is gone (kill -9, a
    # lost connection) is that run's, the one being resumed: take it over instead of refusing.
    take_over_stale: bool = False


def discovered(facts: HostFacts) -> Discovered:
    names = {g.name for g in facts.gpus}
    return Discovered(
        gpu_name=facts.gpus[0].name if len(names) == 1 else (", ".join(sorted(names)) or None),
        gpu_count=len(facts.gpus), gpu_memory_mib=min((g.memory_mib for g in facts.gpus), default=None),
        nvlink=facts.nvlink, gpu_error=facts.gpu_error if facts.gpus or facts.gpu_error else "no GPUs listed",
        model_config=facts.model_config, model_error=facts.model_error, model_readable=facts.model_readable,
        vllm_version=facts.vllm_version, vllm_error=facts.vllm_error,
    )


def take(fleet: Fleet, run: HostRun[Any], ctx: PlanContext, templates: jinja2.Environment,
         opts: SnapshotOptions) -> Snapshot | None:
    """The host's snapshot, or None when its plan has errors (the result says so; nothing was touched)."""
    host, result = run.host, run.result
    try:
        inputs = read_inputs(host, ctx)  # the inventory alone: paths for the facts script, input errors early
    except DeployError as exc:
        result.findings = input_errors(exc)
        result.fail(Status.FAILED, "the plan has errors; nothing was touched")
        return None
    session = fleet.connect(run)
    fleet.progress(host.name, "gathering facts")
    gather = gather_command(inputs.model_path, inputs.bin, inputs.user, opts.extra)
    if opts.lock is not None and opts.lock_later:
        with fleet.step(run, "facts"):
            text = session.run(gather).text
        facts = parse_facts(text)
        if not facts.lock_info:
            snap = _build(fleet, run, inputs, ctx, templates, opts, text, facts)
            if snap is None or snap.changes.empty:
                return snap
            return refresh(fleet, run, snap, opts.prune, lock=opts)
    with fleet.step(run, "facts" if opts.lock is None else "lock + facts"):
        text = session.run(gather).text if opts.lock is None else lock_and_gather(fleet, run, opts, gather.intent)
    return _build(fleet, run, inputs, ctx, templates, opts, text, parse_facts(text))


def _build(fleet: Fleet, run: HostRun[Any], inputs: HostInputs, ctx: PlanContext, templates: jinja2.Environment,
           opts: SnapshotOptions, text: str, facts: HostFacts) -> Snapshot | None:
    result = run.result
    with fleet.step(run, "plan") as step:
        plan = build_plan(inputs, ctx, discovered(facts))
        result.findings = [f for f in plan.findings if f.severity is not Severity.INFO]
        if not plan.ok:
            step.status = StepStatus.FAILED
            result.fail(Status.FAILED, "the plan has errors; nothing was touched")
            return None
    files = render_host(plan, templates) if opts.render else []
    changes = converge.compute_changes(plan, files, facts, opts.prune, plan.tuning.stable_seconds)
    return Snapshot(plan, facts, files, changes, time.monotonic(), text)


def down(host: str, snap: Snapshot, units: Sequence[str], *, installed_only: bool) -> list[str]:
    """"host unit: why" for each of `units` that does not serve now (a rollout's pre-flight); with
    `installed_only`, a unit not installed yet is new, not down."""
    out = []
    for unit in units:
        problem = converge.serving_problem(unit, snap.facts, snap.plan.tuning.stable_seconds)
        if problem is not None and (unit in snap.facts.units or not installed_only):
            out.append(f"{host} {unit}: {problem}")
    return out


def refresh(fleet: Fleet, run: HostRun[Any], snap: Snapshot, prune: bool,
            lock: SnapshotOptions | None = None) -> Snapshot:
    """Re-read the facts and recompute the changes against the same plan. With `lock` (a snapshot read without
    the lock found something to change), take the deploy lock in the same round trip; without, it is held
    already or not wanted."""
    assert run.session is not None
    plan = snap.plan
    gather = gather_command(plan.model_path, plan.bin, plan.user)
    if lock is None:
        with fleet.step(run, "facts (re-checked)"):
            facts = parse_facts(run.session.run(gather).text)
    else:
        with fleet.step(run, "lock + facts"):
            facts = parse_facts(lock_and_gather(fleet, run, lock, gather.intent))
    changes = converge.compute_changes(plan, snap.files, facts, prune, plan.tuning.stable_seconds)
    return Snapshot(snap.plan, facts, snap.files, changes, time.monotonic(), snap.text)


def lock_and_gather(fleet: Fleet, run: HostRun[Any], opts: SnapshotOptions, gather: Intent) -> str:
    """Take the lock and gather facts in one round trip; with --lock-wait retry the same atomic step."""
    assert run.session is not None and opts.lock is not None
    host = run.host.name
    deadline = time.monotonic() + opts.lock_wait
    delay = 1.0
    broken: set[str] = set()
    while True:
        r = run.session.run(lock.acquire_command(opts.lock, gather))
        if r.code == 0:
            run.lock_token = opts.lock.token
            return r.text
        if r.code != lock.HELD_EXIT:
            raise RemoteError(Failure.COMMAND, f"taking the deploy lock failed ({r.code}): "
                              f"{r.stderr.decode(errors='replace').strip()}", where=host)
        holder = lock.parse_info(r.text.split("\n", 1)[1] if "\n" in r.text else "")
        if opts.take_over_stale and holder is not None and holder.token not in broken \
                and stale_and_mine(holder, opts.lock):
            broken.add(holder.token)  # once: a break that did not take must not loop
            fleet.progress(host, f"taking over the stale lock of the stopped run (pid {holder.pid})")
            run.session.run(lock.break_command(holder.token))  # only that holder's: a newer one is never broken
            continue
        if time.monotonic() >= deadline or fleet.abort.is_set():
            held = LockHeld(holder, host)
            if opts.take_over_stale:
                held.hint = ("--resume takes over only its own stale locks (this user on this controller, the "
                             "holder process gone); if the holder is dead, break the locks on every host at once: "
                             "ernie-deploy lock -i INV --break (add --force for another controller's)")
            raise held
        fleet.progress(host, f"waiting for the deploy lock ({holder.describe() if holder else 'held'})")
        time.sleep(min(delay, max(0.1, deadline - time.monotonic())))
        delay = min(delay * 2, 10.0)


def stale_and_mine(holder: lock.LockInfo, me: lock.LockInfo) -> bool:
    """The holder ran as this user on this controller and its process is gone."""
    return holder.user == me.user and holder.controller == me.controller and holder.liveness() == "dead"


def release_lock(run: HostRun[Any]) -> None:
    if run.session is not None and run.lock_token is not None:
        lock.check_release(run.session.run(lock.release_command(run.lock_token)), run.host.name)
        run.lock_token = None
