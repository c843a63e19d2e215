"""What plan, explain and render print: human-readable plans and explanations (rich, through console.py), or
their JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ernie_deploy.errors import DeployError
from ernie_deploy.output import console
from ernie_deploy.output.balancer import balancers_json, fronting_json, show_balancers, show_fronting
from ernie_deploy.output.folding import fold_names
from ernie_deploy.output.gpumap import gpu_map_lines
from ernie_deploy.output.schemas import PLAN_SCHEMA, RENDER_SCHEMA
from ernie_deploy.planning.balancer import BalancerPlan
from ernie_deploy.planning.findings import Severity
from ernie_deploy.planning.memory import GIB
from ernie_deploy.planning.plantypes import HostPlan
from ernie_deploy.planning.render import exec_words
from ernie_deploy.planning.settings import Secret

STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.ADVICE: "cyan", Severity.INFO: "dim"}


def show_plans(plans: Sequence[HostPlan], verbose: bool = False) -> None:
    for plan in plans:
        gpu = f"{plan.gpu_count} × {plan.gpu.name}" if plan.gpu else "GPU unknown"
        status = "[green]ok[/]" if plan.ok else f"[bold red]{len(plan.errors)} error(s)[/]"
        # soft_wrap: long lines run on (the terminal wraps them) rather than rich breaking a message mid-phrase.
        console.out.print(f"[bold]{plan.name}[/] ({plan.address})  {gpu}  row {plan.row or '—'}  "
                          f"profile {plan.profile or '—'}  vLLM {plan.version or '—'}  {status}", soft_wrap=True)
        if plan.instances:
            rows = []
            for i in plan.instances:
                m = i.memory
                rows.append([
                    i.unit, i.port, ",".join(map(str, i.gpus)), i.tensor_parallel_size,
                    i.max_model_len if i.max_model_len is not None else f"{plan.model.derived_max_len} (derived)"
                    if plan.model else "?",
                    i.gpu_memory_utilization,
                    f"{m.weights_per_gpu / GIB:.2f}" if m else "—",
                    f"{m.kv_pool_bytes / GIB:.2f}" if m else "—",
                    f"{m.kv_tokens:,}" if m else "—",
                    f"{m.max_concurrency:.2f}x" if m else "—",
                ])
            console.table(None, ["unit", "port", "GPUs", "TP", "max_model_len", "mem util", "weights GiB/GPU",
                                 "KV GiB/GPU", "KV tokens", "max concurrency"], rows)
            for line in gpu_map_lines(plan):
                console.verbatim(line)
        for f in plan.findings:
            if f.severity is Severity.INFO and not verbose:
                continue
            scope = f" {f.instance}" if f.instance else ""
            # Escaped: rich would read [tp-heads] as a style tag and drop the code.
            console.out.print(f"  [{STYLE[f.severity]}]{f.severity.value}[/] "
                              f"{console.literal(f'[{f.code}]{scope}: {f.message}')}", markup=True, soft_wrap=True)
            if f.vllm_message:
                console.verbatim(f"    vLLM says: {f.vllm_message}")
            if f.fix:
                console.verbatim(f"    fix: {f.fix}")
        if verbose:
            for f in plan.silenced:
                console.verbatim(f"  silenced {f.severity.value} [{f.code}]: {f.message} (ernie_ignore)")
        console.out.print()


# Which setting each rendered flag comes from.
FLAG_SETTINGS = {
    "--served-model-name": "served_model_name", "--host": "host", "--port": "port",
    "--tensor-parallel-size": "tensor_parallel_size", "--pipeline-parallel-size": "pipeline_parallel_size",
    "--max-model-len": "max_model_len", "--gpu-memory-utilization": "gpu_memory_utilization",
    "--shutdown-timeout": "drain_timeout",
}


def flag_sources(plan: HostPlan) -> list[list[str]]:
    """Rows of (instance, flag, value, why) for every flag of every instance's ExecStart."""
    rows = []
    for inst in plan.instances:
        words = exec_words(plan, inst)
        i = 3
        while i < len(words):
            flag = words[i]
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            setting = FLAG_SETTINGS.get(flag)
            if setting in plan.settings:
                why = f"{setting}: {plan.settings[setting].source}"
            elif setting == "served_model_name":
                suffixed = inst.index and inst.served_model_name.endswith(f"-{inst.index}")
                why = "last part of the model path" + (f", suffix -{inst.index} (vllm_served_model_name_suffix)"
                                                       if suffixed else "")
            elif plan.profile and flag in _profile_args(plan):
                why = f"profile {plan.profile}"
            else:
                why = "vllm_extra_args"
            rows.append([inst.unit, flag, value, why])
            i += 2 if value else 1
    return rows


def _profile_args(plan: HostPlan) -> tuple[str, ...]:
    extra = plan.tuning.extra_args
    args = plan.instances[0].args if plan.instances else ()
    return args[: len(args) - len(extra)]


def show_explain(plan: HostPlan) -> None:
    console.out.print(f"[bold]{plan.name}[/]: why each setting has its value")
    rows = []
    for name, s in plan.settings.items():
        value = "[REDACTED]" if isinstance(s.value, Secret) else s.value
        rows.append([name, value, f"{s.source} ({s.where})" if s.where else s.source])
    console.table(None, ["setting", "value", "source"], rows)
    if plan.gpu:
        console.out.print(f"GPUs: {plan.gpu_count} × {plan.gpu.name} ({plan.gpu.memory_mib} MiB, "
                          f"{'NVLink' if plan.gpu.nvlink else 'PCIe only'}); row: {plan.row or 'none'}")
    if plan.model:
        m = plan.model
        kind = f"MoE, {m.num_experts} experts" if m.is_moe else "dense"
        console.out.print(f"model: {m.name} ({m.architecture}, {kind}, "
                          f"{m.param_count / 1e9:.2f} B params, {m.weight_bytes / GIB:.2f} GiB {m.dtype}); "
                          f"{m.num_attention_heads} heads / {m.num_kv_heads} KV heads; derived max length "
                          f"{m.derived_max_len} from {m.max_len_key}; "
                          f"valid TP: {', '.join(map(str, m.valid_tp_sizes()))}",
                          markup=False)
    if plan.ok:
        console.table("flags of each unit's ExecStart", ["unit", "flag", "value", "why"], flag_sources(plan))


def show_fleet(plans: Sequence[HostPlan], verbose: bool = False) -> None:
    """`plan` of several hosts: one line per host, hosts whose plans read the same folded into one line
    (gpu-a10-[02:40]), then each finding once with the hosts it applies to. Plain lines, never cut: a narrow
    terminal wraps them rather than dropping the GPU list or the KV tokens."""
    groups: dict[tuple[object, ...], list[HostPlan]] = {}
    for plan in plans:
        groups.setdefault(_fleet_key(plan), []).append(plan)
    rows = [["host", "GPUs", "row", "profile", "instances", "max_model_len", "vLLM", "verdict"]]
    rows += [[fold_names([p.name for p in members]), *_fleet_cells(members[0])] for members in groups.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        console.verbatim("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    told: dict[tuple[object, ...], list[str]] = {}
    for plan in plans:
        for f in plan.findings:
            if f.severity is not Severity.INFO or verbose:
                told.setdefault((f.severity.value, f.code, f.instance, f.message, f.vllm_message, f.fix), []).append(
                    plan.name)
    if told:
        console.verbatim("")
    for (severity, code, instance, message, vllm_message, fix), hosts in told.items():
        scope = f" {instance}" if instance else ""
        console.verbatim(f"{severity} [{code}] {fold_names(hosts)}{scope}: {message}")
        if vllm_message:
            console.verbatim(f"    vLLM says: {vllm_message}")
        if fix:
            console.verbatim(f"    fix: {fix}")
    console.verbatim("")


def _fleet_cells(plan: HostPlan) -> list[str]:
    gpu = f"{plan.gpu_count} × {plan.gpu.name}" if plan.gpu else "unknown"
    tps = [i.tensor_parallel_size for i in plan.instances]
    instances = (f"{len(tps)} × TP {tps[0]}" if tps and len(set(tps)) == 1 else
                 " + ".join(f"TP {t}" for t in tps) or "—")
    lens = dict.fromkeys(str(i.max_model_len) if i.max_model_len is not None else "derived" for i in plan.instances)
    verdict = "ok" if plan.ok else f"{len(plan.errors)} error(s)"
    return [gpu, plan.row or "—", plan.profile or "—", instances, "/".join(lens) or "—", plan.version or "—",
            verdict]


def _fleet_key(plan: HostPlan) -> tuple[object, ...]:
    """What makes two hosts' lines and findings read the same (their names and addresses aside)."""
    findings = tuple((f.severity, f.code, f.instance, f.message, f.fix) for f in plan.findings)
    return (*_fleet_cells(plan), findings)


def show_plan_command(plans: Sequence[HostPlan], *, json: bool, verbose: bool,
                      balancers: Sequence[BalancerPlan] = (),
                      balancer_failures: Mapping[str, DeployError] | None = None) -> None:
    """`plan`: every host's plan, every selected balancer's, and a one-line summary; or the plan JSON."""
    failed = balancer_failures or {}
    if json:
        console.print_json({"schema": PLAN_SCHEMA, "ok": all(p.ok for p in plans) and not failed,
                            "hosts": [p.to_json() for p in plans], "balancers": balancers_json(balancers, failed)})
        return
    if verbose or len(plans) == 1:
        show_plans(plans, verbose=verbose)  # the per-instance tables: -v, or one host (--limit HOST)
    else:
        show_fleet(plans)
    show_balancers(balancers, failed)
    bad = [p.name for p in plans if not p.ok]
    summary = f"{len(plans)} host(s), {len(bad)} with errors" + (f": {', '.join(bad)}" if bad else "")
    if balancers or failed:
        summary += f"; {len(balancers) + len(failed)} balancer(s), {len(failed)} with errors" + (
            f": {', '.join(failed)}" if failed else "")
    console.out.print(summary, markup=False)


def show_explain_command(plan: HostPlan, *, json: bool, balancers: Sequence[str] = ()) -> None:
    """`explain HOST` of a vLLM host; `balancers`: the inventory's balancer hosts, which front its instances."""
    if json:
        console.print_json({"schema": PLAN_SCHEMA, **plan.to_json(), "balancers": fronting_json(plan, balancers)})
        return
    show_explain(plan)
    show_plans([plan], verbose=True)
    show_fronting(plan, balancers)


def show_render(written: Sequence[str], failed: Mapping[str, DeployError], *, json: bool) -> None:
    """`render`: the files written, and the hosts that could not be rendered (on stderr)."""
    if json:
        console.print_json({"schema": RENDER_SCHEMA, "written": list(written),
                            "failed": {h: str(e) for h, e in failed.items()}})
        return
    for path in written:
        console.out.print(f"wrote {path}", markup=False)
    for exc in failed.values():
        console.error(exc)
