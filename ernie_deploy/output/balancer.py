"""What plan, explain and render print about the fleet's balancers (group vllm_balancers): where each listens,
and per served model its backend's servers with their weights. The API key never appears, only whether the
health check sends one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ernie_deploy.errors import DeployError
from ernie_deploy.output import console
from ernie_deploy.planning.balancer import BalancerPlan, instance_weight
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.settings import Setting


def _listen(plan: BalancerPlan) -> str:
    return f"[{plan.bind}]:{plan.port}" if ":" in plan.bind else f"{plan.bind}:{plan.port}"


def balancer_json(plan: BalancerPlan) -> dict[str, Any]:
    return {
        "host": plan.host,
        "address": plan.address,
        "kind": plan.kind,
        "ok": True,
        "bind": plan.bind,
        "port": plan.port,
        "admin_socket": plan.admin_socket,
        "config_path": plan.config_path,
        "check_interval": plan.check_interval,
        "template": plan.template,
        "backends": [{
            "name": b.name,
            "model": b.model,
            "default": i == 0,
            "check_sends_api_key": b.api_key is not None,
            "servers": [{"name": s.name, "host": s.host, "instance": s.index, "unit": f"{s.unit}.service",
                         "address": s.address, "port": s.port, "weight": s.weight} for s in b.servers],
        } for i, b in enumerate(plan.backends)],
    }


def failed_json(host: str, exc: DeployError) -> dict[str, Any]:
    return {"host": host, "ok": False, "error": exc.message, "where": exc.where, "fix": exc.hint}


def balancers_json(plans: Sequence[BalancerPlan], failed: Mapping[str, DeployError]) -> list[dict[str, Any]]:
    return [*(balancer_json(p) for p in plans), *(failed_json(h, e) for h, e in failed.items())]


def show_balancers(plans: Sequence[BalancerPlan], failed: Mapping[str, DeployError]) -> None:
    for plan in plans:
        console.out.print(f"[bold]balancer {plan.host}[/] ({plan.address})  {plan.kind}  listens {_listen(plan)}  "
                          f"checks every {plan.check_interval:g} s  config {plan.config_path}  [green]ok[/]")
        rows = [[b.model + (" (default)" if i == 0 else ""), b.name, s.name, f"{s.address}:{s.port}", s.weight]
                for i, b in enumerate(plan.backends) for s in b.servers]
        console.table(None, ["model", "backend", "server", "address", "weight"], rows)
        console.out.print()
    for host, exc in failed.items():
        console.out.print(f"[bold]balancer {host}[/]  [bold red]cannot be planned[/]")
        where = f"{exc.where}: " if exc.where and exc.where != host else ""
        console.out.print(f"  error: {where}{exc.message}", markup=False)
        if exc.hint:
            console.out.print(f"    fix: {exc.hint}", markup=False)
        console.out.print()


def show_balancer_explain(host: str, settings: Mapping[str, Setting], plan: BalancerPlan | None,
                          problem: DeployError | None, *, json: bool, schema: str) -> None:
    """`explain BALANCER`: each balancer variable with its source, then what it fronts (or why it cannot)."""
    if json:
        doc = balancer_json(plan) if plan is not None else failed_json(host, problem or DeployError("not planned"))
        doc["settings"] = {f"vllm_{k}": {"value": s.value, "source": s.source} for k, s in settings.items()}
        console.print_json({"schema": schema, "balancer": doc})
        return
    console.out.print(f"[bold]{host}[/]: a balancer (group vllm_balancers): why each setting has its value")
    console.table(None, ["variable", "value", "source"],
                  [[f"vllm_{k}", s.value, s.source] for k, s in settings.items()])
    if plan is not None:
        show_balancers([plan], {})
    elif problem is not None:
        show_balancers([], {host: problem})


def fronting_json(plan: HostPlan, balancers: Sequence[str]) -> dict[str, Any]:
    """`explain HOST --json`'s view of a vLLM host from its balancers."""
    servers = []
    for inst in plan.instances:
        weight, why = instance_weight(plan, inst)
        servers.append({"name": f"{plan.name}-{inst.index}", "weight": weight, "weight_source": why})
    return {"fronted_by": list(balancers), "servers": servers}


def show_fronting(plan: HostPlan, balancers: Sequence[str]) -> None:
    """`explain HOST`: which balancers front the host's instances, under which server names and weights."""
    if not balancers:
        console.out.print("balancers: none (the inventory has no group vllm_balancers)", markup=False)
        return
    doc = fronting_json(plan, balancers)
    console.table(f"balancers {', '.join(balancers)} front its instances as", ["server", "weight", "why"],
                  [[s["name"], s["weight"], s["weight_source"]] for s in doc["servers"]])
