"""What `export` prints: where the project went and how to run it, or the export JSON."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ernie_deploy.output import console
from ernie_deploy.output.schemas import EXPORT_SCHEMA


def say_plan_errors(hosts: Sequence[str]) -> None:
    console.error(f"the plan has errors on {', '.join(hosts)}; nothing was written (run `ernie-deploy plan` for the "
                  "fixes)")


def show_export(output: Path, hosts: Sequence[str], files: Sequence[str], *, json: bool,
                next_step: str | None = None) -> None:
    """`files`: the paths written, relative to `output`; `next_step`: what to run (default: the Ansible play)."""
    if json:
        console.print_json({"schema": EXPORT_SCHEMA, "output": str(output), "hosts": list(hosts),
                            "files": list(files)})
        return
    console.out.print(f"wrote {len(files)} files for {len(hosts)} host(s) to {output}", markup=False)
    console.out.print(next_step or f"next: cd {output} && ansible-playbook site.yml -e @vault.yml (see README.md)",
                      markup=False)
