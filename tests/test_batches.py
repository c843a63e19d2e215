"""Rollout batches and the stop rule must be Ansible's: `serial` and `max_fail_percentage`.

The worked examples pin the arithmetic; a property test calls ansible-core's own batching function on
random inputs; and the real ansible-playbook runs on local hosts to show the batches it forms and where a
failing rollout stops. ansible-core is a test dependency: a missing ansible-playbook fails, never skips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ernie_deploy.errors import DeployError
from ernie_deploy.planning.batches import (
    SerialItem,
    batch_stops,
    form_batches,
    parse_percentage,
    parse_serial,
)


def hosts(n: int) -> list[str]:
    return [f"h{i:02d}" for i in range(1, n + 1)]


def sizes(n: int, serial: list[SerialItem] | None, canary: int = 0) -> list[int]:
    return [len(b) for b in form_batches(hosts(n), serial, canary)]


# --- batches: worked examples -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "serial", "expected"),
    [
        (10, [1, 2, "50%"], [1, 2, 5, 2]),  # 50% is of all 10 hosts, and the last item repeats
        (7, ["30%"], [2, 2, 2, 1]),  # 30% of 7 is 2.1, floored
        (10, [1, 5, "20%"], [1, 5, 2, 2]),
        (7, ["15%"], [1] * 7),  # 1.05 floors to 1
        (3, ["10%"], [1, 1, 1]),  # 0.3 floors to 0, and a percentage is at least 1 host
        (7, ["99%"], [6, 1]),
        (10, [2, 0], [2, 8]),  # 0: all remaining hosts
        (10, [0], [10]),
        (10, [-1], [10]),  # Ansible's own default: any count below 1 is "the rest"
        (3, ["0%"], [1, 1, 1]),  # Ansible: int(0) or 1
        (4, ["100%"], [4]),
        (5, [2], [2, 2, 1]),
        (3, [10], [3]),
        (5, ["2"], [2, 2, 1]),  # a count written as a string, as YAML `serial: "2"` gives it
        (5, None, [5]),
        (5, [], [5]),
    ],
)
def test_batch_sizes(n: int, serial: list[SerialItem] | None, expected: list[int]) -> None:
    assert sizes(n, serial) == expected


def test_batches_keep_host_order() -> None:
    assert form_batches(hosts(5), [2]) == [["h01", "h02"], ["h03", "h04"], ["h05"]]


def test_batches_do_not_alias_the_input() -> None:
    given_hosts = hosts(3)
    batches = form_batches(given_hosts, None)
    batches[0].append("x")
    assert given_hosts == hosts(3)


def test_no_hosts_no_batches() -> None:
    assert form_batches([], [1, "50%"]) == []
    assert form_batches([], None, canary=2) == []


def test_batches_of_any_type() -> None:
    assert form_batches([3, 1, 2], [1, 0]) == [[3], [1, 2]]


# --- canary -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "serial", "canary", "expected"),
    [
        (10, None, 1, [1, 9]),
        (10, [3], 1, [1, 3, 3, 3]),
        (10, ["50%"], 2, [2, 4, 4]),  # 50% of the 8 hosts after the canary, not of 10
        (11, ["30%"], 1, [1, 3, 3, 3, 1]),
        (10, [1, 2, "50%"], 1, [1, 1, 2, 4, 2]),
        (10, [2, 0], 3, [3, 2, 5]),
        (5, [2], 0, [2, 2, 1]),
        (5, [2], 5, [5]),  # the canary is every host: one batch
        (5, [2], 9, [5]),
        (1, None, 1, [1]),
    ],
)
def test_canary_sizes(n: int, serial: list[SerialItem] | None, canary: int, expected: list[int]) -> None:
    assert sizes(n, serial, canary) == expected


def test_canary_hosts_come_first() -> None:
    assert form_batches(hosts(4), [2], canary=1) == [["h01"], ["h02", "h03"], ["h04"]]


def test_negative_canary_is_rejected() -> None:
    with pytest.raises(DeployError, match="-1") as info:
        form_batches(hosts(3), None, canary=-1)
    assert info.value.hint


def test_bad_serial_item_in_form_batches_is_rejected() -> None:
    with pytest.raises(DeployError, match=re.escape("'33.3%'")):
        form_batches(hosts(3), ["33.3%"])


# --- parse_serial ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", [3]),
        ("30%", ["30%"]),
        ("1,2,50%", [1, 2, "50%"]),
        (" 1 , 2 ,  50% ", [1, 2, "50%"]),
        ("30 %", ["30%"]),
        ("0", [0]),
        ("2,0", [2, 0]),
        ("0%", ["0%"]),
        ("100%", ["100%"]),
        ("007", [7]),
    ],
)
def test_parse_serial(text: str, expected: list[SerialItem]) -> None:
    assert parse_serial(text) == expected


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("", "''"),
        ("   ", "'   '"),
        ("-1", "'-1'"),
        ("1,-2", "'-2'"),
        ("-10%", "'-10%'"),
        ("33.3%", "'33.3%'"),
        ("1.5", "'1.5'"),
        ("101%", "'101%'"),
        ("abc", "'abc'"),
        ("1,,2", "'1,,2'"),
        ("1,2,", "'1,2,'"),
        ("%", "'%'"),
        ("5%%", "'5%%'"),
        ("+3", "'+3'"),
        ("1 2", "'1 2'"),
        ("٣", "'٣'"),
    ],
)
def test_parse_serial_rejects(text: str, bad: str) -> None:
    with pytest.raises(DeployError) as info:
        parse_serial(text)
    assert bad in info.value.message
    assert info.value.hint is not None and "30%" in info.value.hint and "1,2,50%" in info.value.hint


# --- parse_percentage -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("30", 30.0), ("30%", 30.0), ("30.5", 30.5), (" 30.5 % ", 30.5), ("0", 0.0), ("100", 100.0),
     ("100%", 100.0), (".5", 0.5), ("7.", 7.0)],
)
def test_parse_percentage(text: str, expected: float) -> None:
    assert parse_percentage(text) == expected


@pytest.mark.parametrize("text", ["", "%", "-1", "100.1", "101%", "abc", "nan", "inf", "1e2", "30%%", "3 0"])
def test_parse_percentage_rejects(text: str) -> None:
    with pytest.raises(DeployError) as info:
        parse_percentage(text)
    assert repr(text) in info.value.message
    assert info.value.hint is not None and "30" in info.value.hint


# --- batch_stops ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failed", "unreachable", "size", "pct", "stops"),
    [
        (0, 0, 5, None, False),
        (4, 0, 5, None, False),  # without max_fail_percentage only a whole failed batch stops
        (5, 0, 5, None, True),
        (3, 2, 5, None, True),  # unreachable hosts count for the whole-batch rule
        (0, 5, 5, None, True),
        (2, 0, 5, 40, False),  # strictly greater: 40% of 5 failed does not stop at 40
        (3, 0, 5, 40, True),
        (3, 0, 10, 30, False),
        (4, 0, 10, 30, True),
        (11, 0, 20, 55, False),  # (11 / 20) * 100 is 55.00000000000001 in floats; Ansible compares 0.55 > 0.55
        (7, 0, 25, 28, False),  # likewise 28.000000000000004
        (12, 0, 20, 55, True),
        (1, 0, 3, 33.3, True),
        (1, 0, 3, 34, False),
        (0, 4, 5, 0, False),  # unreachable hosts do not count for the percentage
        (1, 4, 10, 5, True),
        (1, 0, 10, 0, True),  # 0: any failure stops
        (0, 0, 10, 0, False),
        (4, 0, 5, 100, False),
        (5, 0, 5, 100, True),  # a whole failed batch stops even at 100
        (4, 1, 5, 100, True),
        (1, 0, 1, 100, True),
    ],
)
def test_batch_stops(failed: int, unreachable: int, size: int, pct: float | None, stops: bool) -> None:
    assert batch_stops(failed, unreachable, size, pct) is stops


# --- against ansible-core's own function ---------------------------------------------------------------------

serial_items = st.one_of(st.integers(min_value=-2, max_value=12),
                         st.integers(min_value=0, max_value=100).map(lambda p: f"{p}%"))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=0, max_value=40), serial=st.lists(serial_items, max_size=4))
def test_batches_equal_ansible_core_function(n: int, serial: list[SerialItem]) -> None:
    """Call PlaybookExecutor._get_serialized_batches itself, with a stand-in for the inventory and play."""
    from ansible.executor.playbook_executor import PlaybookExecutor  # type: ignore[import-untyped]

    names = hosts(n)
    inventory = SimpleNamespace(get_hosts=lambda pattern, order: list(names))
    play = SimpleNamespace(hosts="all", order="inventory", serial=list(serial))
    expected = PlaybookExecutor._get_serialized_batches(SimpleNamespace(_inventory=inventory), play)
    assert form_batches(names, serial) == expected


# --- against the real ansible-playbook -----------------------------------------------------------------------

BATCH_LINE = re.compile(r"BATCH (\w+) ([\w,]+) END")


def _ansible_playbook() -> str:
    path = shutil.which("ansible-playbook")
    if path is None:
        pytest.fail("`ansible-playbook` is not on PATH; the Ansible-equivalence tests need ansible-core: "
                    "run `pip install -e .[test]`")
    return path


@dataclass
class Run:
    stdout: str
    returncode: int

    def batches(self) -> dict[str, list[list[str]]]:
        """Play name → the batches it ran, in order, from the run_once marker task."""
        found: dict[str, list[list[str]]] = {}
        for play, names in BATCH_LINE.findall(self.stdout):
            found.setdefault(play, []).append(names.split(","))
        return found


def _run_playbook(tmp: Path, inventory: dict[str, object], plays: list[dict[str, object]]) -> Run:
    tmp.mkdir()
    (tmp / "inventory.yml").write_text(yaml.safe_dump(inventory, sort_keys=False))
    (tmp / "playbook.yml").write_text(yaml.safe_dump(plays, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        ANSIBLE_HOME=str(tmp / "home"),
        ANSIBLE_LOCAL_TEMP=str(tmp / "tmp"),
        ANSIBLE_STDOUT_CALLBACK="default",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_HOST_KEY_CHECKING="false",
        ANSIBLE_RETRY_FILES_ENABLED="false",
        ANSIBLE_DEPRECATION_WARNINGS="false",
        ANSIBLE_FORKS="10",
    )
    # The working directory holds only our two files, so no stray ansible.cfg is read.
    proc = subprocess.run([_ansible_playbook(), "-i", "inventory.yml", "playbook.yml"], capture_output=True,
                          text=True, env=env, cwd=tmp, timeout=180, check=False)
    return Run(proc.stdout + proc.stderr, proc.returncode)


def _marker(play: str) -> dict[str, object]:
    # debug runs on the controller, so the marker costs no connection; run_once prints it once per batch.
    message = f"BATCH {play} {{{{ ansible_play_batch | join(',') }}}} END"
    return {"name": "batch marker", "ansible.builtin.debug": {"msg": message}, "run_once": True}


def _play(name: str, group: str, serial: list[SerialItem], tasks: list[dict[str, object]] | None = None,
          **extra: object) -> dict[str, object]:
    # order: inventory is Ansible's default, written out because form_batches takes hosts in that order.
    return {"name": name, "hosts": group, "gather_facts": False, "order": "inventory", "serial": serial, **extra,
            "tasks": [_marker(name), *(tasks or [])]}


def test_batches_equal_ansible_playbook(tmp_path: Path) -> None:
    cases: dict[str, tuple[int, list[SerialItem]]] = {
        "mixed": (10, [1, 2, "50%"]),
        "percent": (7, ["30%"]),
        "rest": (10, [2, 0]),
    }
    inventory: dict[str, object] = {"all": {
        "vars": {"ansible_connection": "local"},
        "children": {name: {"hosts": {h: None for h in hosts(n)}} for name, (n, _) in cases.items()},
    }}
    run = _run_playbook(tmp_path / "serial", inventory, [_play(name, name, s) for name, (_, s) in cases.items()])
    assert run.returncode == 0, run.stdout
    assert run.batches() == {name: form_batches(hosts(n), s) for name, (n, s) in cases.items()}, run.stdout


@dataclass
class Rollout:
    """A play that fails or cannot reach some hosts; batch_stops must stop it where ansible-playbook does."""

    n: int
    serial: list[SerialItem]
    max_fail_percentage: float | None
    batches_run: int  # what the scenario is meant to show, stated apart from batch_stops
    failing: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)

    def expected(self) -> list[list[str]]:
        started: list[list[str]] = []
        for batch in form_batches(hosts(self.n), self.serial):
            started.append(batch)
            failed = sum(h in self.failing for h in batch)
            lost = sum(h in self.unreachable for h in batch)
            if batch_stops(failed, lost, len(batch), self.max_fail_percentage):
                break
        return started

    def inventory(self) -> dict[str, object]:
        # Port 1 on the loopback refuses at once, so these hosts are unreachable without a timeout wait.
        far = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1}
        return {"all": {
            "vars": {"ansible_connection": "local"},
            "hosts": {h: (far if h in self.unreachable else None) for h in hosts(self.n)},
        }}

    def play(self) -> dict[str, object]:
        extra = {} if self.max_fail_percentage is None else {"max_fail_percentage": self.max_fail_percentage}
        tasks: list[dict[str, object]] = [
            {"name": "planned failure", "ansible.builtin.fail": {"msg": "planned"},
             "when": f"inventory_hostname in {sorted(self.failing)!r}"},
        ]
        if self.unreachable:
            # raw needs no Python on the host, and it is the task that meets an unreachable host.
            tasks.insert(0, {"name": "connect", "ansible.builtin.raw": "true"})
        return _play("rollout", "all", self.serial, tasks, **extra)


ROLLOUTS = {
    # 2/5 is not more than 40%: on to batch 2, where 3/5 stops it before batch 3.
    "strictly-greater": Rollout(15, [5], 40, 2, failing={"h01", "h02", "h06", "h07", "h08"}),
    # 11/20 passes at 55 although (11 / 20) * 100 is 55.00000000000001 in floats; 12/20 stops.
    "float-boundary": Rollout(41, [20], 55, 2, failing=set(hosts(11)) | set(hosts(32)[20:])),
    # Even at 100 a batch in which every host failed or was unreachable stops the play.
    "whole-batch-at-100": Rollout(6, [2], 100, 2, failing={"h01", "h03"}, unreachable={"h04"}),
    # Without max_fail_percentage only the whole-batch rule stops.
    "no-percentage": Rollout(6, [2], None, 2, failing={"h01", "h03", "h04"}),
    # Unreachable hosts do not count for the percentage: even 0 lets batch 1 through.
    "unreachable-not-counted": Rollout(6, [2], 0, 3, unreachable={"h01"}),
    "zero-stops-on-one-failure": Rollout(6, [2], 0, 1, failing={"h02"}),
}


def test_rollout_stops_where_ansible_playbook_stops(tmp_path: Path) -> None:
    # A play that stops ends the whole playbook, so each rollout is its own run; they run side by side.
    with ThreadPoolExecutor(max_workers=len(ROLLOUTS)) as pool:
        runs = dict(zip(ROLLOUTS, pool.map(lambda item: _run_playbook(tmp_path / item[0], item[1].inventory(),
                                                                         [item[1].play()]), ROLLOUTS.items()),
                        strict=True))
    for name, rollout in ROLLOUTS.items():
        run = runs[name]
        expected = rollout.expected()
        assert len(expected) == rollout.batches_run, name
        assert run.batches().get("rollout") == expected, f"{name}:\n{run.stdout}"
        assert run.returncode != 0, f"{name}: some host failed, so ansible-playbook must not exit 0"
