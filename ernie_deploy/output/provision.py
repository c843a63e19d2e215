"""What `provision` prints: each host's steps and a recap, or the provision JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ernie_deploy.orchestration.details import ProvisionReport
from ernie_deploy.orchestration.results import HostResult
from ernie_deploy.orchestration.steps import StepStatus
from ernie_deploy.output import console
from ernie_deploy.output.remote import host_error
from ernie_deploy.output.schemas import PROVISION_SCHEMA


def show_provision(results: Sequence[HostResult], reports: Mapping[str, ProvisionReport], code: int, *, check: bool,
                   json: bool, verbose: int = 0) -> None:
    """Per host its status, what changed (or would), and any error; -v adds the steps that found everything in
    place."""
    if json:
        console.print_json({"schema": PROVISION_SCHEMA, "check": check, "exit_code": code, "hosts": {
            r.host: {"status": r.status.value, "error": r.message or None, "hint": r.hint,
                     "commands": r.commands, "seconds": round(r.seconds, 3), **reports[r.host].to_json()}
            for r in results}})
        return
    for r in results:
        error = host_error(r)
        console.out.print(error or f"{r.host}: {r.status.value}", markup=False, highlight=False)
        for a in reports[r.host].actions:
            if a["status"] == StepStatus.OK and not verbose:
                continue
            console.out.print(f"    {a['step']}: {a['status']}: {a['detail']}", markup=False, highlight=False)
    console.out.print("\nRECAP", markup=False)
    for r in results:
        changed = sum(1 for a in reports[r.host].actions if a["status"] in ("changed", "would change"))
        console.out.print(f"{r.host:<26} : {r.status.value:<12} changed={changed:<3} commands={r.commands}",
                          markup=False, highlight=False)
