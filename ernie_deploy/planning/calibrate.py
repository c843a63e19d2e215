"""`ernie-deploy calibrate`, the pure part: one canary host per GPU class, the candidate grid (TP × max_model_len ×
max_num_seqs) each validated by the planner and bounded, the ranking of what was measured, and the measured row
written into a table file (docs/calibrate.md).

A candidate reaches the planner as inventory variables of the canary (vllm_tensor_parallel_size,
vllm_max_model_len, and `--max-num-seqs N` at the end of vllm_extra_args: no setting has it), so it is validated,
rendered and deployed exactly as an operator's own values would be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ernie_deploy.errors import InventoryError
from ernie_deploy.planning.bench import BenchResult, BenchSpec
from ernie_deploy.planning.hardware import Catalog
from ernie_deploy.planning.memory import batch_defaults
from ernie_deploy.planning.plan import HostLike, PlanContext, plan_host
from ernie_deploy.planning.plantypes import HostPlan

MAX_NUM_SEQS = "--max-num-seqs"
MIN_LEN = 256  # the shortest context tried: below it the model's own prompts (chat templates) barely fit
H = TypeVar("H", bound=HostLike)


@dataclass(frozen=True)
class Candidate:
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int

    def label(self) -> str:
        return f"TP {self.tensor_parallel_size}, max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}"

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Skipped:
    candidate: Candidate
    reason: str


@dataclass(frozen=True)
class Grid:
    """A canary's candidates: `tried` in order (at most the bound), `invalid` with the planner's reason, and
    `over` the valid ones the bound left out."""

    tried: tuple[Candidate, ...]
    invalid: tuple[Skipped, ...]
    over: tuple[Candidate, ...]


def gpu_class(plan: HostPlan) -> str:
    """The class a canary stands for: GPU model × count, e.g. "2 × NVIDIA A10"."""
    return f"{plan.gpu_count} × {plan.gpu.name if plan.gpu else '?'}"


def canaries(hosts: Sequence[H], ctx: PlanContext) -> tuple[list[tuple[H, HostPlan]], list[tuple[str, str]]]:
    """The first host of each GPU class among `hosts` with its inventory plan, and the classes' other hosts
    (name, the canary standing for them). A host whose plan has errors is bad input: nothing is touched."""
    chosen: dict[str, tuple[H, HostPlan]] = {}
    others: list[tuple[str, str]] = []
    for host in hosts:
        plan = plan_host(host, ctx)
        if not plan.ok:
            first = plan.errors[0]
            raise InventoryError(f"the plan has errors: {first.message}", where=host.name,
                                 hint=first.fix or f"ernie-deploy plan --limit {host.name} lists them")
        key = gpu_class(plan)
        if key in chosen:
            others.append((host.name, chosen[key][0].name))
        else:
            chosen[key] = (host, plan)
    return list(chosen.values()), others


def _extra_args(plan: HostPlan) -> list[str]:
    """The host's vllm_extra_args without a --max-num-seqs of its own (the candidate's replaces it)."""
    args, out, skip = list(plan.tuning.extra_args), [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == MAX_NUM_SEQS:
            skip = True
        elif not arg.startswith(MAX_NUM_SEQS + "="):
            out.append(arg)
    return out


def overrides(plan: HostPlan, candidate: Candidate, keep_releases: int) -> dict[str, Any]:
    """The candidate as the canary's inventory variables. `keep_releases`: each candidate stages a release, and
    the one that ran before must outlive them all to be restored."""
    return {"vllm_tensor_parallel_size": candidate.tensor_parallel_size,
            "vllm_max_model_len": candidate.max_model_len,
            "vllm_extra_args": [*_extra_args(plan), MAX_NUM_SEQS, str(candidate.max_num_seqs)],
            "vllm_keep_releases": max(plan.tuning.keep_releases, keep_releases)}


def with_vars(host: H, extra: Mapping[str, Any]) -> H:
    """The host with `extra` variables on top of its own (an inventory Host is a frozen dataclass)."""
    made: H = dataclasses.replace(host, vars={**host.vars, **extra})  # type: ignore[type-var]
    return made


def _round_up(tokens: int) -> int:
    size = MIN_LEN
    while size < tokens:
        size *= 2
    return size


def grid(plan: HostPlan, spec: BenchSpec) -> list[Candidate]:
    """Every candidate, most telling first: TP values the model allows on the host's GPUs; max_model_len the
    workload's need rounded up to a power of two, twice that, and the plan's own (else the model's); max_num_seqs
    the workload's concurrency and vLLM's default for the GPU. Ordered by how far a candidate is from the smallest
    length and batch, then by TP, so a bound keeps every TP at the first level."""
    assert plan.model is not None and plan.gpu is not None
    w = spec.workload
    need = w.input_len + w.output_len
    limit = plan.model.derived_max_len
    own = plan.instances[0].max_model_len if plan.instances else None
    lens = sorted({n for n in (_round_up(need), 2 * _round_up(need), own or limit) if need <= n <= limit})
    concurrency = w.max_concurrency or w.num_prompts
    seqs = sorted({concurrency, batch_defaults(plan.gpu.name, plan.gpu.memory_mib * 2**20)[1]})
    tps = plan.model.valid_tp_sizes(limit=plan.gpu_count)
    cells = [(li + si, tp, Candidate(tp, n, s)) for li, n in enumerate(lens) for si, s in enumerate(seqs)
             for tp in tps]
    return [c for _, _, c in sorted(cells, key=lambda cell: (cell[0], cell[1]))]


def choose(host: H, plan: HostPlan, spec: BenchSpec, ctx: PlanContext, bound: int) -> Grid:
    """The grid validated by the planner (a candidate whose plan has errors is skipped with the first one), the
    first `bound` valid ones tried."""
    tried: list[Candidate] = []
    invalid: list[Skipped] = []
    over: list[Candidate] = []
    for candidate in grid(plan, spec):
        checked = plan_host(with_vars(host, overrides(plan, candidate, bound + 2)), ctx)
        if not checked.ok:
            invalid.append(Skipped(candidate, checked.errors[0].message))
        elif len(tried) < bound:
            tried.append(candidate)
        else:
            over.append(candidate)
    return Grid(tuple(tried), tuple(invalid), tuple(over))


@dataclass(frozen=True)
class Measurement:
    """A candidate's numbers over the canary's instances: throughputs summed, latencies the worst instance's."""

    output_throughput: float
    request_throughput: float | None
    goodput: float | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    itl_p99_ms: float | None
    met: bool  # every instance finished and met every SLO

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure(results: Sequence[BenchResult | None], met: bool) -> Measurement | None:
    """None when an instance has no complete result (nothing to rank it by)."""
    done = [r for r in results if r is not None and not r.partial and r.output_throughput is not None]
    if not done or len(done) != len(results):
        return None

    def total(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(v for v in values if v is not None)

    def worst(metric: str) -> float | None:
        values = [r.metric(metric, "p99") for r in done]
        return None if any(v is None for v in values) else max(v for v in values if v is not None)

    return Measurement(output_throughput=sum(r.output_throughput or 0.0 for r in done),
                       request_throughput=total([r.request_throughput for r in done]),
                       goodput=total([r.goodput for r in done]), ttft_p99_ms=worst("ttft"),
                       tpot_p99_ms=worst("tpot"), itl_p99_ms=worst("itl"), met=met)


def best(measured: Sequence[tuple[Candidate, Measurement | None]]) -> tuple[Candidate, Measurement] | None:
    """The winner among those that met every SLO: the highest output throughput, then the lower p99 TTFT, then
    the earlier (smaller) candidate. None when none met them."""
    met = [(i, c, m) for i, (c, m) in enumerate(measured) if m is not None and m.met]
    if not met:
        return None
    _, c, m = max(met, key=lambda t: (t[2].output_throughput, -(t[2].ttft_p99_ms or 0.0), -t[0]))
    return c, m


def row_name(plan: HostPlan) -> str:
    gpu = (plan.gpu.name if plan.gpu else "gpu").removeprefix("NVIDIA ").replace(" ", "-")
    return f"calibrated-{plan.gpu_count}x{gpu}"


def measured_row(plan: HostPlan, base: Mapping[str, Any], candidate: Candidate, m: Measurement, *, date: str,
                 spec: BenchSpec, tried: int, vllm_version: str) -> dict[str, Any]:
    """The winner as a table row: the settings of the row it replaces (`base`), the candidate's on top, and
    `measured:` with where, when, which vLLM (the one the host ran), the workload, the SLOs and the numbers."""
    extra = [a for a in base.get("extra_args", []) if a != MAX_NUM_SEQS]
    return {"name": row_name(plan), "gpu_model": plan.gpu.name if plan.gpu else None, "gpu_count": plan.gpu_count,
            **{k: v for k, v in base.items() if k not in ("name", "gpu_model", "gpu_count", "measured")},
            "tensor_parallel_size": candidate.tensor_parallel_size, "max_model_len": candidate.max_model_len,
            "extra_args": [*extra, MAX_NUM_SEQS, str(candidate.max_num_seqs)],
            "use": f"measured by ernie-deploy calibrate ({tried} candidate(s) tried)",
            "measured": {"date": date, "vllm_version": vllm_version, "host": plan.name, "model": plan.model_path,
                         "workload": spec.workload.to_json(), "slo": spec.slo.to_json(), "max_num_seqs":
                         candidate.max_num_seqs, "results": m.to_json()}}


def _same_class(row: Mapping[str, Any], gpu: str, count: int, catalog: Catalog) -> tuple[bool, bool]:
    """(the row matches this class, it names this GPU model alone)."""
    models = row.get("gpu_model")
    names = models if isinstance(models, list) else [models]
    found = [catalog.lookup(str(n)) for n in names]
    hits = [g is not None and g.name == gpu for g in found]
    return row.get("gpu_count") == count and any(hits), row.get("gpu_count") == count and all(hits)


def merge(table: Mapping[str, Any], row: Mapping[str, Any], catalog: Catalog) -> dict[str, Any]:
    """`table` with `row` where the first row of its GPU class was (the first match wins), rows of that class
    for this GPU model alone removed; a row shared with other GPU models stays after it, for those."""
    gpu, count = str(row["gpu_model"]), int(row["gpu_count"])
    rows: list[Any] = list(table.get("rows") or [])
    at = next((i for i, r in enumerate(rows) if isinstance(r, Mapping) and _same_class(r, gpu, count, catalog)[0]),
              len(rows))
    drop = {i for i, r in enumerate(rows) if isinstance(r, Mapping) and _same_class(r, gpu, count, catalog)[1]}
    head = [r for i, r in enumerate(rows[:at]) if i not in drop]
    tail = [r for i, r in enumerate(rows) if i >= at and i not in drop]
    return {**table, "rows": [*head, dict(row), *tail]}

