"""Rollout options shared by deploy, restart and rollback, and what they turn into."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ernie_deploy.errors import DeployError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ernie_deploy.orchestration.balancers import BalancerControl
    from ernie_deploy.orchestration.bench import SloGate
    from ernie_deploy.orchestration.cycle import CycleOptions
    from ernie_deploy.orchestration.rollout import Report, RolloutOptions
    from ernie_deploy.planning.balancer import BalancerPlan


def add_options(p: argparse.ArgumentParser, *, rollback: bool = True, instance: bool = False) -> None:
    from ernie_deploy.playbook.actions import ACTIONS
    knobs = ACTIONS["rolling"].args  # the playbook's rolling tasks take the same knobs, with the same defaults
    g = p.add_argument_group("rollout", "batches, drain and the readiness gate (docs/rolling.md, docs/hooks.md)")
    g.add_argument("--serial", metavar="S",
                   help="hosts per batch, like Ansible's serial: a count, N%%, or a list such as 1,2,50%% (the "
                        "last repeats; 0 in a list means the rest); 'all' takes every host down at once and must "
                        "be asked for by name. Default: rolling: hosts whose instances serve go the inventory's "
                        "vllm_serial at a time (1 unless set), after the hosts with nothing running, together "
                        "(--check names the batches)")
    g.add_argument("--canary", type=int, default=0, metavar="N",
                   help="the first N hosts form a batch of their own; the first batch must pass every check "
                        "before the rest start")
    g.add_argument("--max-fail-percentage", metavar="P",
                   help="stop when more than P%% of a batch's hosts fail (a batch that fails whole always stops)")
    g.add_argument("--pre-drain", metavar="CMD",
                   help="run on the controller before an instance is stopped (take it out of the load balancer); "
                        "ERNIE_* variables say which; non-zero exit stops the rollout")
    g.add_argument("--post-ready", metavar="CMD",
                   help="run after an instance passed the readiness gate (put it back); also for every instance "
                        "whose pre-drain ran and that ends serving (the rollout stopped, Ctrl-C, a verified "
                        "rollback). One left out is named, and the next run (--resume) puts it back")
    g.add_argument("--hook-timeout", type=float, default=knobs["hook_timeout"].default, metavar="S",
                   help="longest a hook may run")
    g.add_argument("--idle-timeout", type=float, default=knobs["idle_timeout"].default, metavar="S",
                   help="wait up to S seconds after the pre-drain hook for vLLM's running + waiting requests to "
                        "reach 0 (vllm_drain_timeout stays vLLM's own --shutdown-timeout)")
    g.add_argument("--gpu-release-timeout", type=float, default=knobs["gpu_release_timeout"].default, metavar="S",
                   help="wait up to S seconds after a stop for the instance's GPUs to be free")
    g.add_argument("--parallel-instances", action="store_true",
                   help="restart all of a host's instances at once instead of one at a time")
    g.add_argument("--force", action="store_true",
                   help="start the rollout although instances in scope are already down")
    g.add_argument("--no-balancer", action="store_true",
                   help="leave the inventory's balancers (group vllm_balancers) alone: no drain before and no "
                        "ready after each restart, and deploy applies no balancer configuration. Only for a "
                        "balancer that is down or cannot be planned, when you accept that requests it sends to an "
                        "instance while that restarts are lost (the output says the balancers were not driven)")
    g.add_argument("--resume", action="store_true",
                   help="continue a stopped rollout (same inventory, --limit, --instance) with its next batch: "
                        "first post-ready for instances it left out of the load balancer, and its own stale "
                        "deploy locks (this user and controller, process gone) are taken over")
    g.add_argument("--no-slo-gate", action="store_true",
                   help="skip the SLO gate, for an emergency: by default, when the hosts set SLOs (vllm_slo_*, "
                        "docs/bench.md), the instances of the first batch of serving hosts (the canary) are benched "
                        "with vllm bench serve once they pass their checks, and one that misses its SLOs fails like "
                        "a failed start: it is rolled back and the rollout stops (--check says which batch)")
    if rollback:
        g.add_argument("--no-rollback", action="store_true",
                       help="keep a failed instance as it failed (for debugging) instead of restoring what ran before")
    if instance:
        g.add_argument("--instance", metavar="K", help="only this instance of each host: its index or unit name")
    g.add_argument("--timeline", type=Path, metavar="FILE",
                   help="draw the rollout as FILE.svg or FILE.html: one row per instance, its phases on a time axis")


def validate(args: argparse.Namespace) -> None:
    """The rollout options' own bad values, judged before the command contacts any host (deploy, restart and
    rollback call it before rollout_options)."""
    from ernie_deploy.planning.batches import parse_percentage, serial_of
    if args.canary < 0:
        raise DeployError(f"--canary must be 0 or more, got {args.canary}", hint="--canary 1 makes the first host "
                                                                                  "a batch of its own")
    if args.timeline is not None and args.timeline.suffix.lower() not in (".svg", ".html", ".htm"):
        raise DeployError(f"--timeline {args.timeline}: the file must end in .svg or .html",
                          hint="--timeline rollout.svg")
    if args.serial is not None:
        serial_of(args.serial, "--serial")
    if args.max_fail_percentage:
        parse_percentage(args.max_fail_percentage)


def slo_gate(args: argparse.Namespace) -> SloGate:
    """The rollout's SLO gate, one object for cycle_options and rollout_options (the rollout names its batch)."""
    from ernie_deploy.orchestration.bench import SloGate
    return SloGate(enabled=not args.no_slo_gate)


def cycle_options(args: argparse.Namespace, command: str, balancers: BalancerControl | None = None,
                  plans: Sequence[BalancerPlan] = (), gate: SloGate | None = None) -> CycleOptions:
    from ernie_deploy.orchestration.cycle import CycleOptions
    return CycleOptions(command=command, pre_drain=args.pre_drain, post_ready=args.post_ready,
                        hook_timeout=args.hook_timeout, idle_timeout=args.idle_timeout,
                        gpu_timeout=args.gpu_release_timeout, parallel_instances=args.parallel_instances,
                        rollback=not getattr(args, "no_rollback", False), balancers=balancers,
                        balancer_plans=tuple(plans), slo_gate=gate)


def rollout_options(args: argparse.Namespace, command: str, *, preflight: bool,
                    balancers: Sequence[str] = (), gate: SloGate | None = None) -> RolloutOptions:
    from ernie_deploy.orchestration import resume
    from ernie_deploy.orchestration.rollout import RolloutOptions
    from ernie_deploy.planning.batches import parse_percentage, serial_of
    key = None if getattr(args, "check", False) else \
        resume.key_of(command, args.inventory.key(), args.limit, getattr(args, "instance", None))
    return RolloutOptions(
        serial=serial_of(args.serial, "--serial") if args.serial is not None else None, rolling=True,
        canary=args.canary,
        max_fail_percentage=parse_percentage(args.max_fail_percentage) if args.max_fail_percentage else None,
        force=args.force, preflight=preflight, resume_key=key, resume=args.resume, command=command,
        balancer_hosts=tuple(balancers), slo_gate=gate)


def write_timeline(args: argparse.Namespace, report: Report, title: str) -> None:
    from ernie_deploy.output import timeline
    if args.timeline is not None:
        timeline.write(report.timeline, args.timeline, title)
