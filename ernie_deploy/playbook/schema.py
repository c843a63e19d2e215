"""The playbook format: a list of plays, each a host pattern and the toolkit's own tasks (docs/playbooks.md).

Everything is checked when the file is read (keys, actions, argument types, log patterns, serial and
percentages, host patterns' syntax, tags asked for on the command line), so a typo stops the run with
FILE:LINE, the key path and the closest valid name before any host is contacted.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.checks.expectations import Expectations
from ernie_deploy.errors import ConfigError, DeployError
from ernie_deploy.planning.batches import SerialItem, parse_percentage, parse_serial
from ernie_deploy.planning.settings import BENCH_TYPES, check_type
from ernie_deploy.playbook.actions import ACTIONS, BENCH_PARTS, NUMBER, STRINGS, watch_problem
from ernie_deploy.playbook.yamlmarks import Marked, load

TASK_KEYS = {"name", "tags"}
PLAY_KEYS = {"name", "hosts", "vars", "serial", "max_fail_percentage", "any_errors_fatal", "canary", "tags", "tasks"}


@dataclass(frozen=True)
class Task:
    action: str
    args: Mapping[str, Any]
    name: str
    tags: frozenset[str]  # its own, its play's, and its action's name
    where: str  # FILE:LINE

    @property
    def changes_hosts(self) -> bool:
        return ACTIONS[self.action].changes_hosts

    def arg(self, name: str) -> Any:
        """The argument as the task gives it, else its default from the registry (playbook/actions.py)."""
        return self.args.get(name, ACTIONS[self.action].args[name].default)

    def number(self, name: str) -> float:
        return float(self.arg(name))

    def flag(self, name: str) -> bool:
        return bool(self.arg(name))

    def text(self, name: str) -> str | None:
        value = self.arg(name)
        return None if value is None else str(value)


@dataclass(frozen=True)
class Play:
    name: str
    hosts: str
    vars: Mapping[str, Any]
    serial: list[SerialItem] | None
    max_fail_percentage: float | None
    any_errors_fatal: bool
    canary: int
    tasks: tuple[Task, ...]
    where: str


@dataclass(frozen=True)
class Playbook:
    path: Path
    plays: tuple[Play, ...] = ()
    tags: frozenset[str] = field(default_factory=frozenset)

    def expectations(self) -> Expectations:
        """What its `verify` tasks add (for `verify --playbook` and `deploy --playbook`)."""
        out = Expectations()
        for play in self.plays:
            for task in play.tasks:
                if task.action == "verify":
                    out = out.merged(verify_expectations(task))
        return out

    def selected(self, tags: Sequence[str] = (), skip: Sequence[str] = ()) -> Playbook:
        """The playbook with only the tasks `--tags` / `--skip-tags` select, like ansible-playbook: a task
        runs when it has one of `tags` (or `tags` is empty, or it is tagged `always`) and none of `skip`."""
        unknown = [t for t in [*tags, *skip] if t not in self.tags and t not in ("always", "never", "all")]
        if unknown:
            hint = closest(unknown[0], self.tags)
            raise ConfigError(f"tag {unknown[0]!r} is on no task of this playbook", where=str(self.path),
                              hint=(hint + "; " if hint else "") + f"its tags: {', '.join(sorted(self.tags))}")
        wanted, skipped = set(tags) - {"all"}, set(skip)

        def keep(task: Task) -> bool:
            if task.tags & skipped:
                return False
            if "never" in task.tags and not task.tags & wanted:
                return False
            return not wanted or bool(task.tags & (wanted | {"always"}))

        plays = tuple(Play(p.name, p.hosts, p.vars, p.serial, p.max_fail_percentage, p.any_errors_fatal, p.canary,
                           tuple(t for t in p.tasks if keep(t)), p.where) for p in self.plays)
        return Playbook(self.path, plays, self.tags)


def verify_expectations(task: Task) -> Expectations:
    return Expectations(tuple(task.arg("expect")), tuple(task.arg("forbid")), task.flag("stream"))


def closest(word: str, choices: Sequence[str] | set[str] | frozenset[str]) -> str:
    """'did you mean X?' for the nearest valid name, or ''."""
    found = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f"did you mean {found[0]!r}?" if found else ""


def load_playbook(path: Path, valid_pattern: Callable[[str], str | None] | None = None) -> Playbook:
    """Read and check a whole playbook. `valid_pattern(pattern)` returns why a play's `hosts` pattern is
    wrong (unknown group or host), or None; without it only the type is checked."""
    doc = load(path, root="plays")
    data = doc.data
    if isinstance(data, dict) and "verify" in data:
        raise doc.error("", "this is the old `verify:` file format; a playbook is a list of plays",
                        hint="wrap it as a play: `- hosts: all` / `  tasks:` / `    - verify: {expect: [...], ...}` "
                             "(see playbooks/verify.yml)")
    if not isinstance(data, list) or not data:
        raise doc.error("", "a playbook is a non-empty list of plays (`- hosts: PATTERN` with `tasks:`)",
                        hint="see playbooks/site.yml")
    plays = tuple(_play(doc, f"plays[{i}]", item, valid_pattern) for i, item in enumerate(data))
    tags = frozenset(t for p in plays for task in p.tasks for t in task.tags)
    return Playbook(path, plays, tags)


def _unknown(doc: Marked, key: str, name: str, valid: Collection[str], what: str) -> ConfigError:
    hint = closest(name, set(valid))
    return doc.error(f"{key}.{name}" if key else name, f"unknown {what}",
                     hint=(hint + "; " if hint else "") + f"valid: {', '.join(sorted(valid))}")


def _expect(doc: Marked, key: str, value: Any, kind: type | tuple[type, ...] | str) -> Any:
    if kind == STRINGS:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise doc.error(key, f"expected a list of strings, got {type(value).__name__} {value!r}")
        for i, item in enumerate(value):
            _expect(doc, f"{key}[{i}]", item, str)
        return tuple(value)
    assert not isinstance(kind, str)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; `true` where a number belongs is a mistake, not a 1.
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = "number" if kinds == NUMBER else " or ".join(k.__name__ for k in kinds)
        raise doc.error(key, f"expected {names}, got {type(value).__name__} {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise doc.error(key, f"must be 0 or more, got {value}")
    return value


def _play(doc: Marked, key: str, item: Any, valid_pattern: Callable[[str], str | None] | None) -> Play:
    if not isinstance(item, dict):
        raise doc.error(key, f"a play is a mapping with hosts and tasks, got {type(item).__name__}")
    for name in item:
        if name not in PLAY_KEYS:
            raise _unknown(doc, key, str(name), PLAY_KEYS, "play key")
    if "hosts" not in item:
        raise doc.error(key, "a play needs `hosts:` (an inventory pattern such as all, a10, 'a100:!a100-3')")
    hosts = _expect(doc, f"{key}.hosts", item["hosts"], str)
    if valid_pattern is not None:
        problem = valid_pattern(hosts)
        if problem:
            raise doc.error(f"{key}.hosts", problem)
    variables = _expect(doc, f"{key}.vars", item.get("vars") or {}, dict)
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise doc.error(f"{key}.vars", f"variable name {name!r} is not an identifier")
    serial = None
    if "serial" in item:
        raw = item["serial"]
        values = raw if isinstance(raw, list) else [raw]
        for i, v in enumerate(values):
            _expect(doc, f"{key}.serial" + (f"[{i}]" if isinstance(raw, list) else ""), v, (int, str))
        serial = _parsed(doc, f"{key}.serial", lambda: parse_serial(",".join(str(v) for v in values)))
    mfp = None
    if "max_fail_percentage" in item:
        raw = _expect(doc, f"{key}.max_fail_percentage", item["max_fail_percentage"], (int, float, str))
        mfp = _parsed(doc, f"{key}.max_fail_percentage", lambda: parse_percentage(str(raw)))
    play_tags = _tags(doc, f"{key}.tags", item.get("tags"))
    tasks_raw = item.get("tasks")
    if not isinstance(tasks_raw, list) or not tasks_raw:
        raise doc.error(f"{key}.tasks", "a play needs a non-empty list of tasks",
                        hint=f"tasks are one action each: {', '.join(ACTIONS)}")
    tasks = tuple(_task(doc, f"{key}.tasks[{i}]", t, play_tags) for i, t in enumerate(tasks_raw))
    name = _expect(doc, f"{key}.name", item.get("name", hosts), str)
    return Play(name, hosts, dict(variables), serial, mfp,
                _expect(doc, f"{key}.any_errors_fatal", item.get("any_errors_fatal", False), bool),
                _expect(doc, f"{key}.canary", item.get("canary", 0), int), tasks, doc.where(key))


def bench_overrides(task: Task) -> dict[str, Any]:
    """A bench task's `workload:` and `slo:` as bench settings (settings.BENCH_TYPES names)."""
    return {prefix + name: value for part, prefix in BENCH_PARTS.items()
            for name, value in (task.arg(part) or {}).items()}


def _bench_part(doc: Marked, key: str, values: Mapping[Any, Any], prefix: str) -> None:
    """A bench task's `workload:` or `slo:` keys and values, checked as the inventory's vllm_bench_* / vllm_slo_*
    variables are, each problem at its FILE:LINE."""
    valid = [name.removeprefix(prefix) for name in BENCH_TYPES if name.startswith(prefix)]
    for name, value in values.items():
        if name not in valid:
            raise _unknown(doc, key, str(name), valid, key.rsplit(".", 1)[-1] + " key")
        try:
            check_type(prefix + name, value, doc.where(f"{key}.{name}"), BENCH_TYPES)
        except DeployError as exc:
            raise doc.error(f"{key}.{name}", exc.message, hint=exc.hint) from None


def _parsed(doc: Marked, key: str, parse: Callable[[], Any]) -> Any:
    try:
        return parse()
    except DeployError as exc:
        raise doc.error(key, exc.message.split(": ", 1)[-1], hint=exc.hint) from exc


def _tags(doc: Marked, key: str, value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    return frozenset(_expect(doc, key, value, STRINGS))


def _task(doc: Marked, key: str, item: Any, play_tags: frozenset[str]) -> Task:
    # Compiling patterns needs the log checks: loaded only when a playbook is read, not for --help.
    from ernie_deploy.checks.logscan import check_pattern

    if not isinstance(item, dict):
        raise doc.error(key, f"a task is a mapping with one action, got {type(item).__name__} {item!r}",
                        hint=f"actions: {', '.join(ACTIONS)}")
    actions = [k for k in item if k not in TASK_KEYS]
    if not actions:
        raise doc.error(key, "the task has no action", hint=f"actions: {', '.join(ACTIONS)}")
    for name in actions:
        if name not in ACTIONS:
            raise _unknown(doc, key, str(name), {**ACTIONS, **dict.fromkeys(TASK_KEYS)}, "action or task key")
    if len(actions) > 1:
        raise doc.error(f"{key}.{actions[1]}", f"a task has one action, this one has {len(actions)}: "
                        f"{', '.join(actions)}", hint="split it into one task per action")
    action = actions[0]
    raw = item[action]
    args = _expect(doc, f"{key}.{action}", raw if raw is not None else {}, dict)
    spec = ACTIONS[action].args
    checked: dict[str, Any] = {}
    for name, value in args.items():
        if name not in spec:
            if not spec:
                raise doc.error(f"{key}.{action}.{name}", f"{action} takes no arguments")
            raise _unknown(doc, f"{key}.{action}", str(name), spec, f"argument of {action}")
        checked[name] = _expect(doc, f"{key}.{action}.{name}", value, spec[name].kind)
    for name, arg in spec.items():
        if arg.required and name not in checked:
            raise doc.error(f"{key}.{action}", f"{action} needs `{name}:` ({arg.help})")
    if action == "verify":
        for kind in ("expect", "forbid"):
            for i, pattern in enumerate(checked.get(kind, ())):
                # A typo in a pattern must stop the run here, before any host is restarted.
                problem = check_pattern(kind, pattern)
                if problem is not None:
                    raise doc.error(f"{key}.verify.{kind}[{i}]", problem.message, hint=problem.hint)
    if action == "bench":
        for part, prefix in BENCH_PARTS.items():
            _bench_part(doc, f"{key}.bench.{part}", checked.get(part, {}), prefix)
    if action == "watch":
        bounds = watch_problem(float(checked.get("for", spec["for"].default)),
                               float(checked.get("every", spec["every"].default)))
        if bounds is not None:
            raise doc.error(f"{key}.watch.{bounds[0]}", bounds[1], hint=bounds[2])
    if action == "pause" and len(checked) != 1:
        raise doc.error(f"{key}.pause", "pause takes exactly one of `seconds:` or `prompt:`")
    name = _expect(doc, f"{key}.name", item.get("name", action), str)
    tags = _tags(doc, f"{key}.tags", item.get("tags")) | play_tags | {action}
    return Task(action, checked, name, tags, doc.where(key))
