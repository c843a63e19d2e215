"""Versioned JSON of multi-host results. A changed shape gets a new schema version."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.orchestration.steps import Step
from ernie_deploy.output.schemas import RESULTS_SCHEMA

# v2: each host carries its steps, the release a change recorded, leftover units and drop-ins.
# v3: rollouts: each host's batch, per-instance phase timings and rollback actions; the document's "rollout"
# (batches, done, stopped, refused, resumed); each step's ended_at (epoch seconds).
# v4: the rollout's "how" (how its batches were formed) and "out_of_rotation" (host → units left out of the
# load balancer: pre-drain ran, post-ready did not).
# v5: the rollout's "balancers" (the inventory's balancer hosts, whether they were driven, why the rollout refused
# to start); deploy's "hosts" begin with one result per balancer whose configuration it applied; an instance's
# "balancer" phase steps (drain on the balancer, ready again).


def step_json(s: Step) -> dict[str, Any]:
    return {"name": s.name, "status": s.status, "seconds": round(s.seconds, 3), "evidence": s.evidence,
            "changed": s.changed, "ended_at": round(s.ended_at, 3)}


def host_json(r: HostResult) -> dict[str, Any]:
    """The core and the change detail, flat (a host no deploy, restart or rollback reached has empty ones)."""
    ch = r.change
    return {
        "host": r.host, "status": r.status.value, "message": r.message, "hint": r.hint,
        "changed_files": ch.changed_files, "restarted": ch.restarted, "started": ch.started,
        "enabled": ch.enabled, "pruned": ch.pruned, "leftover": ch.leftover, "dropins": ch.dropins,
        "reasons": ch.reasons, "diffs": ch.diffs,
        "findings": [f.to_json() for f in r.findings], "evidence": r.evidence,
        "checks": [c.to_json() for c in r.checks], "steps": [step_json(s) for s in r.steps],
        "release": ch.release, "batch": ch.batch, "timings": r.timings, "rollbacks": ch.rollbacks,
        "remote_commands": r.commands, "seconds": round(r.seconds, 3),
    }


def results_document(command: str, results: Sequence[HostResult], exit_code: int, schema: str = RESULTS_SCHEMA,
                     **extra: Any) -> dict[str, Any]:
    return {"schema": schema, "command": command, **extra, "exit_code": exit_code,
            "hosts": [host_json(r) for r in results]}
