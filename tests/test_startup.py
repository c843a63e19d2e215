"""The command line starts fast because building its parser loads no SSH, terminal, template or lab code:
those load when a command that needs them runs (the start-up figures are in the README's benchmark table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "inventory/example.yml"
HEAVY = ("paramiko", "fabric", "invoke", "rich", "jinja2", "ernie_deploy.orchestration", "ernie_deploy.lab",
         "ernie_deploy.remote.ssh", "ernie_deploy.export", "ernie_deploy.playbook.schema")


def loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nimport json; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_building_the_parser_loads_no_heavy_module() -> None:
    modules = loaded_after("from ernie_deploy.cli.main import build_parser\nbuild_parser()")
    assert not {m for m in modules if m.startswith(HEAVY)}


def test_help_of_every_command_still_works_without_them() -> None:
    code = ("from ernie_deploy.cli.main import build_parser\nimport contextlib, io\np = build_parser()\n"
            "for name in p._subparsers._group_actions[0].choices:\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        p.parse_args([name, '--help'])")
    assert not {m for m in loaded_after(code) if m.startswith(HEAVY)}


def test_plan_loads_what_it_needs_but_no_ssh() -> None:
    modules = loaded_after("from ernie_deploy.cli.main import main\nimport contextlib, io\n"
                           "with contextlib.redirect_stdout(io.StringIO()):\n"
                           f"    main(['plan', '-i', {str(EXAMPLE)!r}])")
    assert "rich" in modules and not {m for m in modules if m.startswith(("paramiko", "fabric", "invoke", "jinja2"))}


def test_json_output_and_progress_off_a_terminal_load_no_rich() -> None:
    """A script reading --json (stderr not a terminal: no live progress) prints through neither of rich's
    consoles, so rich is never imported; text output still loads it."""
    code = ("from ernie_deploy.cli.main import main\nimport contextlib, io\n"
            "from ernie_deploy.output.console import HostProgress\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['plan', '-i', {str(EXAMPLE)!r}, '--json'])\n"
            "with HostProgress('deploy') as progress:\n    progress.update('gpu-a10-01', 'gathering facts')")
    done = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint(sorted(sys.modules))"],
                          capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    assert "'rich'" not in done.stdout and "'ernie_deploy.output.console'" in done.stdout
