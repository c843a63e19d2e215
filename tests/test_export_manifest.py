"""Exports never delete what they did not write (issue 38): a manifest lists each exporter's files; a re-export
replaces and removes only those, so a git checkout, the user's vault.yml and another exporter's files survive;
a directory with files and no manifest is refused and left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.errors import ExitCode
from ernie_deploy.export.manifest import MANIFEST, parse

HOSTS = "a:\n  hosts:\n" + "".join(
    f"    h{i}:\n      ansible_host: 127.0.0.{i}\n      gpu_model: NVIDIA A10\n      gpu_count: 2\n" for i in (1, 2))


def export(capsys: pytest.CaptureFixture[str], inv: Path, out: Path, *more: str, target: str = "ansible") -> int:
    rc = main(["export", target, "-i", str(inv), "-o", str(out), *more])
    capsys.readouterr()
    return rc


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_re_export_keeps_the_users_files_and_the_other_exporters(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    inv, out = tmp_path / "inv.yml", tmp_path / "project"
    inv.write_text(HOSTS)
    assert export(capsys, inv, out) == ExitCode.OK
    first = files_under(out)
    assert any(p.startswith("host_files/h2/") or "/h2/" in p for p in first), sorted(first)
    mine = {".git/config": "[core]\n", "vault.yml": "$ANSIBLE_VAULT;1.1;AES256\n00\n", "group_vars/mine.yml": "x: 1\n"}
    for rel, text in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    assert export(capsys, inv, out, target="prometheus") == ExitCode.OK
    assert export(capsys, inv, out, "--limit", "h1") == ExitCode.OK
    now = files_under(out)
    for rel, text in mine.items():
        assert (out / rel).read_text() == text, rel
    assert {p for p in first if "h2" not in p} <= now
    assert not {p for p in now if "h2" in p and not p.startswith(("prometheus", "targets", "rules"))
                and p in first}, "the h2 files of the first export are removed"
    owned = json.loads((out / MANIFEST).read_text())["files"]
    assert set(owned) == {"ansible", "prometheus"} and "prometheus.yml" in owned["prometheus"]
    assert (out / "prometheus.yml").is_file()


def test_a_directory_with_foreign_files_and_no_manifest_is_refused_untouched(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv, out = tmp_path / "inv.yml", tmp_path / "project"
    inv.write_text(HOSTS)
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["export", "ansible", "-i", str(inv), "-o", str(out)]) == ExitCode.INPUT
    err = capsys.readouterr().err
    assert "is not an earlier export" in err and MANIFEST in err
    assert files_under(out) == {"notes.txt"}


def test_an_export_made_before_manifests_is_taken_over_and_nothing_of_it_removed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv, out = tmp_path / "inv.yml", tmp_path / "project"
    inv.write_text(HOSTS)
    out.mkdir()
    (out / MANIFEST).write_text("written by ernie-deploy export ansible; a re-export replaces this directory\n")
    (out / "old-file.yml").write_text("kept\n")
    assert export(capsys, inv, out) == ExitCode.OK
    assert (out / "old-file.yml").read_text() == "kept\n" and (out / "site.yml").is_file()
    assert parse((out / MANIFEST).read_text()) is not None


def test_a_manifest_cannot_make_an_export_remove_files_outside_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    inv, out = tmp_path / "inv.yml", tmp_path / "project"
    inv.write_text(HOSTS)
    outside = tmp_path / "precious.txt"
    outside.write_text("keep\n")
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"files": {"ansible": ["../precious.txt", "/etc/hostname"]}}))
    assert export(capsys, inv, out) == ExitCode.OK
    assert outside.read_text() == "keep\n"
