"""Playbooks: the bundled ones load; every kind of mistake names FILE:LINE, the key path and the closest valid
name, before any host is contacted; tags select tasks the way ansible-playbook does."""

import argparse
import re
from pathlib import Path

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ConfigError
from ernie_deploy.playbook.schema import load_playbook

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["site.yml", "rolling-restart.yml", "verify.yml"])
def test_bundled_playbooks_load(name: str) -> None:
    book = load_playbook(ROOT / "playbooks" / name)
    assert book.plays and all(p.tasks for p in book.plays)


def test_site_runs_the_whole_job_in_order() -> None:
    book = load_playbook(ROOT / "playbooks/site.yml")
    assert [t.action for t in book.plays[0].tasks] == ["provision", "plan", "converge", "rolling", "verify"]
    play = book.plays[0]
    assert play.canary == 1 and play.serial == ["50%"] and play.max_fail_percentage == 0


def test_verify_playbook_gives_the_checks_of_its_verify_tasks() -> None:
    exp = load_playbook(ROOT / "playbooks/verify.yml").expectations()
    assert exp.stream is True
    assert "Using max model len {max_model_len}" in exp.expect
    assert exp.forbid


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "book.yml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message", "line", "hint"), [
    ("- hosts: all\n  tasks:\n    - verfiy: {}\n", r"plays\[0\]\.tasks\[0\]\.verfiy: unknown action", 3,
     "did you mean 'verify'?"),
    ("- hosts: all\n  serail: 1\n  tasks:\n    - verify: {}\n", r"plays\[0\]\.serail: unknown play key", 2,
     "did you mean 'serial'?"),
    ("- hosts: all\n  tasks:\n    - rolling:\n        alwyas: true\n",
     r"plays\[0\]\.tasks\[0\]\.rolling\.alwyas: unknown argument of rolling", 4, "did you mean 'always'?"),
    ("- hosts: all\n  tasks:\n    - verify: {stream: 'yes'}\n", r"verify\.stream: expected bool", 3, None),
    ("- hosts: all\n  tasks:\n    - verify: {expect: [1]}\n", r"verify\.expect\[0\]: expected str", 3, None),
    ("- hosts: all\n  tasks:\n    - wait_ready: {timeout: true}\n", r"wait_ready\.timeout: expected number", 3,
     None),
    ("- hosts: all\n  tasks:\n    - verify: {}\n      converge: {}\n", r"a task has one action", 4, None),
    ("- hosts: all\n  tasks:\n    - hook: {}\n", r"hook needs `run:`", 3, None),
    ("- hosts: all\n  tasks:\n    - plan: {x: 1}\n", r"plan\.x: plan takes no arguments", 3, None),
    ("- hosts: all\n  serial: 'lots'\n  tasks:\n    - verify: {}\n", r"plays\[0\]\.serial", 2, None),
    ("- hosts: all\n  max_fail_percentage: lots\n  tasks:\n    - verify: {}\n", r"max_fail_percentage", 2, None),
    ("- hosts: all\n  tasks: []\n", r"tasks: a play needs a non-empty list of tasks", 2, None),
    ("- tasks:\n    - verify: {}\n", r"a play needs `hosts:`", 1, None),
    ("- hosts: all\n  tasks:\n    - verify: {}\n    - verify: {}\n      verify: {}\n", r"duplicate key", 5, None),
    ("- hosts: all\n  tasks:\n    - pause: {}\n", r"exactly one of", 3, None),
    ("verify: {expect: []}\n", "old `verify:` file format", 1, "wrap it as a play"),
    ("- hosts: all\n  tasks: [\n", "malformed YAML", None, None),
])
def test_mistakes_name_file_line_key_and_the_closest_name(tmp_path: Path, text: str, message: str,
                                                          line: int | None, hint: str | None) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as err:
        load_playbook(path)
    assert err.value.where is not None and err.value.where.startswith(str(path))
    if line is not None:
        assert err.value.where == f"{path}:{line}"
    if hint is not None:
        assert err.value.hint is not None and hint in err.value.hint


@pytest.mark.parametrize(("pattern", "message"), [
    ("Using max model len {max_model_lenn}", r"expect\[1\]: .*unknown placeholder \{max_model_lenn\}"),
    ("bad (regex", r"expect\[1\]: .*not a valid regular expression"),
])
def test_pattern_typos_fail_when_the_playbook_loads(tmp_path: Path, pattern: str, message: str) -> None:
    path = _write(tmp_path, f"- hosts: all\n  tasks:\n    - verify:\n        expect:\n          - ok\n"
                            f"          - '{pattern}'\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_playbook(path)
    assert err.value.where == f"{path}:6"


def test_host_patterns_are_checked_against_the_inventory(tmp_path: Path) -> None:
    path = _write(tmp_path, "- hosts: a10\n  tasks:\n    - verify: {}\n- hosts: a1000\n  tasks:\n    - verify: {}\n")
    with pytest.raises(ConfigError, match="matches no hosts") as err:
        load_playbook(path, lambda p: None if p == "a10" else "host pattern 'a1000' matches no hosts")
    assert err.value.where == f"{path}:4"


BOOK = """\
- hosts: all
  tags: [site]
  tasks:
    - converge: {}
      tags: [deploy]
    - rolling: {}
      tags: [deploy]
    - verify: {}
    - name: debug dump
      command: {run: "true"}
      tags: [never, debug]
    - name: marker
      hook: {run: "true"}
      tags: [always]
"""


@pytest.mark.parametrize(("tags", "skip", "names"), [
    ((), (), ["converge", "rolling", "verify", "marker"]),
    (("verify",), (), ["verify", "marker"]),
    (("deploy",), ("rolling",), ["converge", "marker"]),
    (("debug",), (), ["debug dump", "marker"]),
    ((), ("always",), ["converge", "rolling", "verify"]),
    # Inherited tags count: asking for the play's tag also selects its `never` task, as in Ansible.
    (("site",), (), ["converge", "rolling", "verify", "debug dump", "marker"]),
])
def test_tags_select_tasks_like_ansible(tmp_path: Path, tags: tuple[str, ...], skip: tuple[str, ...],
                                        names: list[str]) -> None:
    book = load_playbook(_write(tmp_path, BOOK)).selected(tags, skip)
    assert [t.name for t in book.plays[0].tasks] == names


def test_an_unknown_tag_is_refused_with_the_closest_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tag 'verfy' is on no task") as err:
        load_playbook(_write(tmp_path, BOOK)).selected(("verfy",))
    assert err.value.hint is not None and "did you mean 'verify'?" in err.value.hint


INV = "all:\n  hosts:\n    h:\n      ansible_host: 127.0.0.1\n      ansible_port: 1\n      gpu_model: NVIDIA A10\n" \
      "      gpu_count: 1\n"


@pytest.mark.parametrize(("book", "args", "expected"), [
    ("- hosts: all\n  tasks:\n    - verfiy: {}\n", [], "verfiy: unknown action"),
    ("- hosts: all\n  tasks:\n    - verify: {expect: ['{nope}']}\n", [], "unknown placeholder"),
    ("- hosts: nosuchgroup\n  tasks:\n    - verify: {}\n", [], "matches no hosts"),
    ("- hosts: all\n  tasks:\n    - command: {run: reboot}\n", [], "--allow-commands"),
    ("- hosts: all\n  tasks:\n    - verify: {}\n", ["--tags", "deploy"], "tag 'deploy' is on no task"),
])
def test_run_with_a_bad_playbook_exits_5_and_contacts_no_host(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              book: str, args: list[str], expected: str) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text(INV)
    path = _write(tmp_path, book)
    # The host is a closed port with a tiny timeout: had it been tried, the error would be "unreachable" (4).
    assert main(["run", str(path), "-i", str(inv), "--connect-timeout", "0.1", *args]) == 5
    err = capsys.readouterr().err
    assert expected in err and str(path) in err


@pytest.mark.parametrize("command", ["deploy", "verify"])
def test_playbook_options_refuse_a_bad_playbook_before_any_host(tmp_path: Path, command: str) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text(INV)
    book = _write(tmp_path, "- hosts: all\n  tasks:\n    - verify: {expect: ['{nope}']}\n")
    assert main([command, "-i", str(inv), "--playbook", str(book), "--connect-timeout", "0.1"]) == 5


def test_the_action_names_run_help_shows_are_the_schemas() -> None:
    from ernie_deploy.cli.main import build_parser
    from ernie_deploy.playbook.schema import ACTIONS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    description = sub.choices["run"].description or ""
    action_names = tuple(description.split("Actions: ", 1)[1].split(". ", 1)[0].split(", "))
    assert tuple(ACTIONS) == action_names


def test_every_action_has_a_handler_and_every_handler_an_action() -> None:
    from ernie_deploy.orchestration.playrun import HANDLERS
    from ernie_deploy.playbook.actions import ACTIONS

    assert set(HANDLERS) == set(ACTIONS)


def test_defaults_come_from_the_registry() -> None:
    from ernie_deploy.playbook.actions import ACTIONS
    from ernie_deploy.playbook.schema import Task

    task = Task("hook", {"run": "true"}, "h", frozenset(), "f:1")
    assert task.number("timeout") == ACTIONS["hook"].args["timeout"].default
    assert Task("hook", {"run": "true", "timeout": 5}, "h", frozenset(), "f:1").number("timeout") == 5.0


def test_the_docs_table_lists_each_action_with_its_arguments_defaults_and_check_mode() -> None:
    from ernie_deploy.playbook.actions import ACTIONS

    text = (ROOT / "docs" / "playbooks.md").read_text()
    rows = {m.group(1): (m.group(2), m.group(3)) for m in
            re.finditer(r"^\| `(\w+)` \| (.+?) \| .+ \| (.+?) \|$", text, re.MULTILINE)}
    assert list(rows) == list(ACTIONS)
    for name, action in ACTIONS.items():
        arguments, check = rows[name]
        assert (check == "skipped") == (not action.runs_in_check), name
        listed = text if arguments == "see below" else arguments
        for arg, spec in action.args.items():
            assert f"`{arg}`" in listed, (name, arg)
            if isinstance(spec.default, float):
                assert f"`{arg}` ({spec.default:g}" in listed, (name, arg)
