"""The driver table (data/vllm_drivers.yml, docs/drivers.md) and the judgement of a host's driver."""

from __future__ import annotations

import pytest

from ernie_deploy.planning.drivers import driver_version, judge, need


def test_every_row_of_the_table_loads_and_names_a_cuda_with_its_drivers() -> None:
    for release in ("0.9.1", "0.9.2", "0.10.1.1", "0.11.0", "0.13.0", "0.18.0", "0.20.0", "0.24.0", "0.27.1",
                    "0.32.0", "0.33.0", "0.34.0"):
        wanted = need(release)
        assert wanted is not None and wanted.exact and wanted.row == release
        assert driver_version(wanted.minimum) is not None


def test_the_host_needs_the_higher_of_torchs_and_vllms_own_cuda() -> None:
    wanted = need("0.9.1")  # torch 2.7.0's wheel is CUDA 12.6, vLLM's kernels are CUDA 12.8
    assert wanted is not None and (wanted.torch, wanted.cuda, wanted.minimum) == ("2.7.0", "12.8", "570.26")
    wanted = need("0.34.0")
    assert wanted is not None and (wanted.cuda, wanted.minimum) == ("13.0", "580.65.06")


def test_a_release_between_rows_uses_the_nearest_lower_one_and_says_so() -> None:
    wanted = need("0.12.0")
    assert wanted is not None and wanted.row == "0.11.0" and not wanted.exact
    assert "no row for 0.12.0, used 0.11.0 (unverified)" in judge("580.95.05", wanted).summary
    assert need("0.8.5") is None  # below the table: no verdict


def test_driver_versions_compare_as_numbers_not_text() -> None:
    assert driver_version("570.124.06") == (570, 124, 6) and driver_version("570.26") == (570, 26)
    wanted = need("0.11.0")
    assert wanted is not None
    assert judge("570.124.06", wanted).ok  # newer than 570.26, though it sorts before it as text


@pytest.mark.parametrize(("driver", "ok", "words"), [
    ("580.95.05", True, "new enough"),
    ("580.65.06", True, "new enough"),
    ("580.10.00", False, "below 580 it cannot run at all"),
    ("550.127.05", False, "even below the minor-version-compatibility minimum"),
    ("[N/A]", None, "not a version number"),
])
def test_judge_names_both_versions(driver: str, ok: bool | None, words: str) -> None:
    wanted = need("0.34.0")
    assert wanted is not None
    verdict = judge(driver, wanted)
    assert verdict.ok is ok and words in verdict.summary, verdict.summary
    if ok is not None:
        assert driver in verdict.summary and "580.65.06" in verdict.summary and "0.34.0" in verdict.summary


def test_vllm_0_32_has_its_own_row_read_from_its_wheel() -> None:
    wanted = need("0.32.0")
    assert wanted is not None and wanted.exact
    assert (wanted.torch, wanted.cuda, wanted.minimum, wanted.floor) == ("2.13.0", "13.0", "580.65.06", "580")
    # The CPU build's version is the same release (docs/drivers.md: its verdict does not apply to CPU hosts).
    cpu = need("0.32.0+cpu")
    assert cpu is not None and cpu.row == "0.32.0" and cpu.exact
    assert "unverified" not in judge("580.95.05", cpu).summary
