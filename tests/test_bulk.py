"""The collector pause around bulk work must always give the collector back as it found it."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

from ernie_deploy.errors import InventoryError
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.bulk import collector_paused
from ernie_deploy.planning.plan import PlanContext, plan_hosts

EXAMPLE = Path(__file__).resolve().parent.parent / "inventory" / "example.yml"


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()


def test_paused_inside_and_restored_after():
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_when_the_work_fails():
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("bad inventory")
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_caller_stays_off():
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_nested_pauses_resume_only_at_the_outermost():
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_loading_and_planning_leave_the_collector_on(tmp_path):
    inventory = load_inventory(EXAMPLE)
    assert gc.isenabled()
    plan_hosts(list(inventory.select(None)), PlanContext.load())
    assert gc.isenabled()
    bad = tmp_path / "bad.yml"
    bad.write_text("all: [unclosed\n")
    with pytest.raises(InventoryError):
        load_inventory(bad)
    assert gc.isenabled()


def test_overlapping_pauses_in_threads_resume_after_the_last():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with collector_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with collector_paused():
            second_in.set()
            first_out.wait(5)
            seen["after the first ended"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after the first ended": False}
    assert gc.isenabled()
