"""The host-output protocol's one reader (remote/protocol.py) and the parsers built on it."""

from __future__ import annotations

import json

from ernie_deploy.remote import converge, releases
from ernie_deploy.remote.protocol import MARK, marker, records, sections, sha256sums, split

DIGEST = "a" * 64


def test_sections_in_order_with_records_kept_inside_theirs() -> None:
    text = (f"noise before any marker\n{MARK}http\n{marker('http')}{{\"id\": 1}}\n{MARK}unit u.service\n"
            f"Id=u.service\n\n{MARK}journal u.service inv-1\nline\n{MARK}end\ntrailing\n")
    found = split(text, records=("http",))
    assert [(s.kind, s.arg) for s in found] == [("http", ""), ("unit", "u.service"), ("journal", "u.service inv-1"),
                                                ("end", "")]
    assert found[0].lines == (f"{marker('http')}{{\"id\": 1}}",) and found[1].body == "Id=u.service"
    assert found[3].lines == ("trailing",)  # the last section is read too
    assert records(text, "http") == ['{"id": 1}']


def test_sections_by_header_later_wins() -> None:
    assert sections(f"{MARK}a\n1\n{MARK}b\n\n2\n\n{MARK}a\n3\n") == {"a": "3", "b": "2"}


def test_sha256sum_output() -> None:
    text = f"{DIGEST}  /etc/systemd/system/ernie-vllm-0.service\nsha256sum: /x: No such file\n{DIGEST}  dir/a b\n"
    assert sha256sums(text) == {"/etc/systemd/system/ernie-vllm-0.service": DIGEST, "dir/a b": DIGEST}


def test_read_files_keep_their_exact_content() -> None:
    text = f"{MARK}file /a\nx=1\r\ny=2\n{MARK}file /b\n{MARK}file /c\nno newline"
    assert converge.parse_read(text) == {"/a": "x=1\r\ny=2\n", "/b": "", "/c": "no newline"}


def test_an_unreadable_release_record_is_named_not_dropped_silently() -> None:
    good = {"id": "20260101T000000.000Z-aaaaaaaa", "files": {}, "changed": []}
    text = (f"{releases.DIR_MARK}20260101T000000.000Z-aaaaaaaa\n{releases.MARK}{json.dumps(good)}\n"
            f"{releases.DIR_MARK}20260102T000000.000Z-bbbbbbbb\n{releases.MARK}\n")  # no release.json there
    kept = releases.parse_list(text)
    assert [r.id for r in kept] == [good["id"]] and kept.skipped == ("20260102T000000.000Z-bbbbbbbb",)
    assert "20260102T000000.000Z-bbbbbbbb" in kept.notes()[0] and "unreadable" in kept.notes()[0]
