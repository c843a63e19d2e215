"""What the host commands print (deploy, restart, rollback, verify, releases, facts, lock): text or their JSON
documents."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

from ernie_deploy.orchestration.bench import InstanceBench
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.orchestration.rollout import Report
from ernie_deploy.output import console
from ernie_deploy.output.jsonout import results_document
from ernie_deploy.output.problem import host_problem
from ernie_deploy.output.recap import show_checks, show_recap, show_results, show_rollout
from ernie_deploy.output.schemas import FACTS_SCHEMA, RELEASES_SCHEMA, VERIFY_SCHEMA
from ernie_deploy.planning.drivers import DriverVerdict
from ernie_deploy.remote.facts import HostFacts
from ernie_deploy.remote.releases import Release


def host_error(r: HostResult) -> str | None:
    return None if not r.finished else host_problem(r.host, r.message, r.hint)


def say_stopped(signum: int | None) -> None:
    if signum is not None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        console.note(f"interrupted ({name}): no new host was started, every lock taken was released; each host's "
                     "result follows")


def say_accept_new(check: bool) -> None:
    dry = " (check mode: it only says what it would record)" if check else ""
    console.note("warning: --host-key-policy accept-new records unknown host keys" + dry)


def report_json(report: Report) -> dict[str, object]:
    return {"batches": report.batches, "done": [k + 1 for k in report.done], "stopped": report.stopped or None,
            "refused": report.refused, "resumed": report.resumed, "how": report.how or None,
            "out_of_rotation": report.rotation.snapshot(),
            "balancers": {"hosts": list(report.balancers), "driven": report.driven,
                          "refused": report.balancer_problems}}


def show_outcome(command: str, results: list[HostResult], code: int, report: Report, *, json: bool, check: bool,
                 verbose: int) -> None:
    """deploy, restart and rollback: every host's result, the rollout's batches and the recap."""
    if json:
        console.print_json(results_document(command, results, code, check=check, rollout=report_json(report)))
    else:
        show_results(results, verbose=verbose)
        show_rollout(report, results, verbose)
        show_recap(results)


def show_verify(results: list[HostResult], code: int, *, json: bool, verbose: int,
                benches: Mapping[str, Sequence[InstanceBench]] | None = None) -> None:
    """verify's checks (with --bench, `benches`: host → its instances' benches, whose verdicts are checks too)."""
    if json:
        doc = results_document("verify", results, code, schema=VERIFY_SCHEMA)
        for host in doc["hosts"]:
            # v2: each host's "bench" (null without --bench): per benched instance, as `bench --json` has it.
            host["bench"] = None if benches is None else [b.to_json() for b in benches.get(host["host"], ())]
        console.print_json(doc)
    else:
        show_checks(results, verbose=verbose)
        show_recap(results)


def show_releases(listed: Sequence[tuple[HostResult, list[Release], str | None]], *, json: bool) -> None:
    if json:
        console.print_json({"schema": RELEASES_SCHEMA, "hosts": {
            r.host: {"error": host_error(r), "current": now,
                     "releases": [{"id": x.id, "time": x.time, "user": x.user, "command": x.command,
                                   "changed": list(x.changed), "files": x.files,
                                   "failed": x.failed.to_json() if x.failed else None} for x in kept]}
            for r, kept, now in listed}})
        return
    for r, kept, now in listed:
        if r.finished:
            console.out.print(host_error(r) or r.host, markup=False)
            continue
        console.out.print(f"{r.host}: {len(kept)} release(s) kept" + ("" if now else
                          "; the installed files match none of them"), markup=False)
        for x in kept:
            changed = ", ".join(p.rsplit("/", 1)[1] for p in x.changed) or "nothing"
            mark = "  (current)" if x.id == now else ""
            console.out.print(f"    {x.id}  {x.time}  {x.user}  {x.command}  changed: {changed}{mark}",
                              markup=False)
            if x.failed is not None:
                console.out.print(f"      FAILED: {x.failed.describe()} (rollback --to {x.id} asks for --force)",
                                  markup=False)
        console.out.print("".join(f"    {note}\n" for note in r.evidence), markup=False, end="")


def show_facts(results: Sequence[tuple[HostResult, HostFacts | None]],
               drivers: Mapping[str, tuple[str, DriverVerdict] | None], *, json: bool) -> None:
    """Each host's facts; `drivers` is its driver judged against the vLLM it runs or pins."""
    if json:
        def driver_json(host: str) -> dict[str, object] | None:
            found = drivers[host]
            return None if found is None else {"vllm": found[0], "ok": found[1].ok, "summary": found[1].summary}

        console.print_json({"schema": FACTS_SCHEMA,
                            "hosts": {r.host: {"facts": f.to_json() if f else None, "error": host_error(r),
                                               "driver_check": driver_json(r.host)}
                                      for r, f in results}})
        return
    for r, facts in results:
        if facts is None:
            console.out.print(host_error(r) or r.host, markup=False)
            continue
        gpus = f"{len(facts.gpus)} × {facts.gpus[0].name} ({facts.gpus[0].memory_mib} MiB, driver " \
               f"{facts.gpus[0].driver})" if facts.gpus else f"no GPUs ({facts.gpu_error})"
        link = {True: "NVLink", False: "PCIe only", None: "n/a"}[facts.nvlink]
        arch = (facts.model_config or {}).get("architectures") or facts.model_error
        installed = facts.vllm_version or facts.vllm_error
        running = facts.running_versions()
        vllm = f"{', '.join(running)} running ({installed} installed)" if running and running != [installed] \
            else installed
        console.out.print(f"{r.host}: {gpus}, {link}; systemd {facts.systemd_version}; vLLM {vllm}; model {arch}",
                          markup=False)
        found = drivers[r.host]
        if found is not None:
            console.out.print(f"    {found[1].summary}", markup=False)
        for unit in facts.units.values():
            runs = facts.running.get(unit.name)
            uses = f" vLLM {runs.version or '?'} ({runs.bin})" if runs else ""
            console.out.print(f"    {unit.name}: {unit.active_state}/{unit.sub_state} pid {unit.main_pid}{uses} "
                              f"restarts {unit.n_restarts}", markup=False)


def show_locks(results: Sequence[tuple[HostResult, str]]) -> None:
    for r, state in results:
        console.out.print(host_error(r) or f"{r.host}: {state}", markup=False)
