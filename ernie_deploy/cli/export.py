"""`export ansible`: write the plan as a self-contained Ansible project (docs/ansible.md); `export prometheus`: its
instances as a Prometheus and Grafana pack (docs/observability.md); thin."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ernie_deploy.errors import DeployError, ExitCode
from ernie_deploy.output.schemas import EXPORT_SCHEMA

if TYPE_CHECKING:
    from ernie_deploy.export.ansible import ExportFile
    from ernie_deploy.inventory.inventory import Inventory


def register(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    p = sub.add_parser("export", help="write the plan as content another engine runs (an Ansible project, a "
                                      "Prometheus and Grafana pack)",
                       description="Plan and render every host as `render` does, then write a self-contained "
                                   "Ansible project: a role (ansible.builtin only) holding the rendered units "
                                   "verbatim and env files whose only variables are the secrets, site.yml, "
                                   "rolling-restart.yml and verify.yml, the inventory with every secret value "
                                   "replaced by a vault variable, and ansible.cfg with host-key checking on. It "
                                   "runs under ansible-playbook, ansible-runner and AWX without ernie-deploy, "
                                   "and keeps ernie-deploy's lock, releases and audit log on the hosts. Touches "
                                   "no host. `export prometheus` writes file-based service discovery targets "
                                   "for every instance's /metrics, alert rules, a Grafana dashboard per vLLM "
                                   "version and a prometheus.yml, every metric name checked against the pinned "
                                   "vLLM's (docs/observability.md). Exit codes: 0 written, 1 a plan has errors "
                                   "(nothing written), 5 bad input.")
    p.add_argument("target", choices=("ansible", "prometheus"), help="what to write")
    common(p)
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="directory to write; an earlier export there is replaced, any other non-empty "
                        "directory is refused")
    p.add_argument("--templates", type=Path, metavar="DIR", help="unit and env templates (as for render)")
    p.add_argument("--serial", default="1", metavar="S",
                   help="hosts per batch of the plays, as for `ernie-deploy restart` (default 1)")
    p.add_argument("--canary", type=int, default=0, metavar="N", help="the first N hosts form a batch of their own")
    p.add_argument("--max-fail-percentage", metavar="P",
                   help="the plays stop when more than P%% of a batch's hosts fail (Ansible's max_fail_percentage)")
    p.add_argument("--pre-drain", default="", metavar="CMD",
                   help="run on the controller before each instance is drained (take it out of the load "
                        "balancer); ERNIE_* variables say which, as for `ernie-deploy restart`")
    p.add_argument("--post-ready", default="", metavar="CMD", help="run after an instance is ready (put it back)")
    p.add_argument("--scrape-interval", type=float, default=15.0, metavar="S",
                   help="prometheus: seconds between scrapes and rule evaluations (default 15); the stall and stuck "
                        "rules look back over several scrapes at least")
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {EXPORT_SCHEMA})")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from ernie_deploy.cli.inventories import load
    from ernie_deploy.export.ansible import ExportOptions, export_files, host_files, masked_balancer
    from ernie_deploy.output.export import say_plan_errors, show_export
    from ernie_deploy.planning.balancer import plan_balancers, render_balancer, split_hosts
    from ernie_deploy.planning.batches import parse_percentage, parse_serial
    from ernie_deploy.planning.plan import HostLike, PlanContext, plan_hosts
    from ernie_deploy.planning.render import render_host, unit_environment
    if args.target == "prometheus":
        return cmd_export_prometheus(args)
    if args.canary < 0:
        raise DeployError(f"--canary must be 0 or more, got {args.canary}")
    options = ExportOptions(serial=parse_serial(args.serial), canary=args.canary,
                            max_fail_percentage=parse_percentage(args.max_fail_percentage)
                            if args.max_fail_percentage else None, pre_drain=args.pre_drain,
                            post_ready=args.post_ready)
    inventory = load(args)
    base_dir = args.inventory.base_dir
    ctx = PlanContext.load(args.table, base_dir=base_dir)
    selected, chosen_balancers = split_hosts(inventory.select(args.limit))
    plans = plan_hosts(list[HostLike](selected), ctx)
    if not plans and not chosen_balancers:
        raise DeployError(f"no host matches --limit {args.limit!r}", where=args.inventory.shown)
    bad = [p.name for p in plans if not p.ok]
    if bad:
        say_plan_errors(bad)
        return ExitCode.PLAN_ERRORS
    # The balancers front every instance of the inventory whatever --limit says: they are planned from all vLLM
    # hosts, and every cycle drives all of them; --limit picks the balancers whose configuration is exported.
    every_vllm, every_balancer = split_hosts(inventory.select(None))
    chosen = {h.name for h in chosen_balancers}
    fronted = plan_hosts(list[HostLike](every_vllm), ctx) if every_balancer else []
    fronts = plan_balancers(every_balancer, fronted, base_dir)
    balancers = [b for b in fronts if b.host in chosen]
    env = unit_environment(args.templates)
    rendered = {p.name: host_files(p, partial(render_host, env=env)) for p in plans}
    configs = {b.host: render_balancer(masked_balancer(b)) for b in balancers}
    files = export_files(_inventory_source(args), plans, rendered, options, balancers, configs, fronts)
    written = write_tree(args.output, "ansible", files)
    hosts = [p.name for p in plans] + [h.name for h in chosen_balancers]
    show_export(args.output, hosts, written, json=args.json)
    return ExitCode.OK


def _inventory_source(args: argparse.Namespace) -> Path | Inventory:
    """What the export writes its inventory from: a single YAML inventory file as the user wrote it, else the
    inventory as read (raw: templates and vault values as they are)."""
    from ernie_deploy.cli.inventories import load_raw
    from ernie_deploy.inventory.sources import classify
    (first, *more) = args.inventory.given
    source = classify(first)
    if not more and not source.foreign and not Path(first).is_dir():
        return Path(first)
    return load_raw(args)


def cmd_export_prometheus(args: argparse.Namespace) -> int:
    from ernie_deploy.checks.progress import thresholds_of
    from ernie_deploy.cli.inventories import load
    from ernie_deploy.export.prometheus import export_files, release_digest
    from ernie_deploy.output.export import say_plan_errors, show_export
    from ernie_deploy.planning.balancer import split_hosts
    from ernie_deploy.planning.plan import HostLike, PlanContext, plan_hosts
    from ernie_deploy.planning.render import render_host, unit_environment
    inventory = load(args)
    ctx = PlanContext.load(args.table, base_dir=args.inventory.base_dir)
    selected, _ = split_hosts(inventory.select(args.limit))
    if not selected:
        raise DeployError(f"no vLLM host matches --limit {args.limit!r}", where=args.inventory.shown)
    thresholds = {h.name: thresholds_of(h.name, h.vars) for h in selected}  # bad values: before anything is planned
    plans = plan_hosts(list[HostLike](selected), ctx)
    bad = [p.name for p in plans if not p.ok]
    if bad:
        say_plan_errors(bad)
        return ExitCode.PLAN_ERRORS
    env = unit_environment(args.templates)
    # The release label is the hash part of the id a deploy of these files records; the files are hashed, never
    # written, so the secrets they hold stay here.
    releases = {p.name: release_digest(render_host(p, env)) for p in plans}
    files = export_files(plans, releases, thresholds, args.scrape_interval)
    written = write_tree(args.output, "prometheus", files)
    show_export(args.output, [p.name for p in plans], written, json=args.json,
                next_step=f"next: prometheus --config.file={args.output}/prometheus.yml (see docs/observability.md)")
    return ExitCode.OK


def write_tree(target: Path, kind: str, files: list[ExportFile]) -> list[str]:
    """Write an export into `target`: each file whole (a temporary file renamed over it), the files this
    exporter wrote last time and no longer writes removed, everything else left alone (export/manifest.py).
    Returns the paths written, the manifest last."""
    import os
    import tempfile

    from ernie_deploy.export.manifest import MANIFEST, Manifest, parse
    if target.exists() and not target.is_dir():
        raise DeployError(f"{target} exists and is not a directory", hint="name a new or empty directory")
    manifest = Manifest()
    if target.is_dir() and any(target.iterdir()):
        found = parse((target / MANIFEST).read_text(encoding="utf-8")) if (target / MANIFEST).is_file() else None
        if found is None:
            raise DeployError(f"{target} holds files and is not an earlier export (it has no {MANIFEST})",
                              hint="name a new or empty directory; an export leaves files it did not write alone "
                                   "only in a directory it made")
        manifest = found
    written = [f.path for f in files]
    for f in files:
        dest = target / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            os.fchmod(fd, f.mode)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(f.content)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    for rel in manifest.stale(kind, written):
        stale = target / rel
        if stale.is_file() or stale.is_symlink():
            stale.unlink()
        for parent in stale.parents:  # directories the export made and emptied
            if parent == target or not parent.is_relative_to(target) or any(parent.iterdir()):
                break
            parent.rmdir()
    (target / MANIFEST).write_text(manifest.with_files(kind, written).to_text(), encoding="utf-8")
    return [*written, MANIFEST]
