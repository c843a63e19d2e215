"""The rollout timeline picture: parsed back with ElementTree, so the tests check geometry, not strings."""

from __future__ import annotations

import itertools
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.steps import Step, StepStatus, phase_timings
from ernie_deploy.orchestration.timeline import PHASES, Mark, Span, Timeline
from ernie_deploy.output.timeline import FAILED, WARN, render, write

NS = {"s": "http://www.w3.org/2000/svg"}
NASTY = "<script>&\"'"


def timeline() -> Timeline:
    """Two batches of a rolling restart; the second instance's drain warned, the third failed to get ready."""
    tl = Timeline(started_at=1_700_000_000.0)
    tl.spans += [
        Span("a10-1 ernie-vllm-0.service", "hook", 0.0, 0.5),
        Span("a10-1 ernie-vllm-0.service", "drain", 0.5, 4.0),
        Span("a10-1 ernie-vllm-0.service", "stop", 4.0, 9.0),
        Span("a10-1 ernie-vllm-0.service", "load", 9.0, 50.0),
        Span("a10-1 ernie-vllm-0.service", "ready", 50.0, 60.0),
        Span("a10-2 ernie-vllm-0.service", "drain", 60.0, 75.0, "warn"),
        Span("a10-2 ernie-vllm-0.service", "stop", 75.0, 80.0),
        Span("a10-2 ernie-vllm-0.service", "load", 80.0, 120.0),
        Span("a10-2 ernie-vllm-0.service", "ready", 120.0, 130.0, "failed"),
    ]
    tl.marks += [Mark(0.0, "batch", "batch 1"), Mark(60.0, "batch", "batch 2"),
                 Mark(130.0, "stop", "stopped: a10-2 failed")]
    return tl


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def spans_of(root: ET.Element) -> list[ET.Element]:
    return root.findall(".//s:rect[@class='span']", NS)


def f(element: ET.Element, name: str) -> float:
    return float(element.attrib[name])


def scale_and_origin(root: ET.Element) -> tuple[float, float]:
    """Pixels per second and the x of t = 0, read off the axis's first and last ticks."""
    ticks = root.findall(".//s:text[@class='tick']", NS)
    first, last = ticks[0], ticks[-1]
    seconds = f(last, "data-seconds") - f(first, "data-seconds")
    scale = (f(last, "x") - f(first, "x")) / seconds
    return scale, f(first, "x") - f(first, "data-seconds") * scale


def test_one_rect_per_span_with_x_and_width_proportional_to_time() -> None:
    tl = timeline()
    root = parse(render(tl, "svg"))
    rects = spans_of(root)
    assert len(rects) == len(tl.spans)
    scale, origin = scale_and_origin(root)
    assert scale > 0
    for rect, span in zip(rects, tl.spans, strict=True):
        assert rect.attrib["data-phase"] == span.phase
        assert f(rect, "x") == pytest.approx(origin + span.start * scale, abs=0.02)
        assert f(rect, "width") == pytest.approx((span.end - span.start) * scale, abs=0.02)


def test_each_rect_has_a_tooltip_with_phase_times_and_status() -> None:
    tl = timeline()
    rects = spans_of(parse(render(tl, "svg")))
    tips = [rect.find("s:title", NS) for rect in rects]
    assert all(tip is not None for tip in tips)
    assert tips[3] is not None and tips[3].text == "load, 9.00–50.00 s, ok"
    assert tips[-1] is not None and tips[-1].text == "ready, 120.00–130.00 s, failed"


def test_one_row_per_instance_in_timeline_order() -> None:
    tl = timeline()
    tl.spans.append(Span("a10-1 ernie-vllm-0.service", "rollback", 130.0, 140.0))  # a row seen again stays put
    root = parse(render(tl, "svg"))
    rows = root.findall(".//s:g[@class='row']", NS)
    assert [r.attrib["data-row"] for r in rows] == tl.rows == ["a10-1 ernie-vllm-0.service",
                                                              "a10-2 ernie-vllm-0.service"]
    tops = []
    for row in rows:
        rects = row.findall("s:rect[@class='span']", NS)
        assert len({f(r, "y") for r in rects}) == 1, "a row's spans share one line"
        tops.append(f(rects[0], "y"))
        label = row.find("s:text[@class='row-label']", NS)
        assert label is not None and "".join(label.itertext()).endswith(row.attrib["data-row"])
    assert tops == sorted(tops) and len(set(tops)) == len(tops)
    assert [r.attrib["data-phase"] for r in rows[0].findall("s:rect[@class='span']", NS)] == [
        "hook", "drain", "stop", "load", "ready", "rollback"]


def test_failed_spans_are_outlined_red_and_warnings_amber() -> None:
    rects = spans_of(parse(render(timeline(), "svg")))
    by_status = {r.attrib["data-status"]: r for r in rects}
    assert by_status["failed"].attrib["stroke"] == FAILED
    assert by_status["warn"].attrib["stroke"] == WARN
    assert "stroke-dasharray" in by_status["warn"].attrib
    assert by_status["ok"].attrib["stroke"] not in (FAILED, WARN)


def test_phases_get_distinct_colours() -> None:
    tl = Timeline()
    tl.spans += [Span("h u", phase, i, i + 1.0) for i, phase in enumerate(PHASES)]
    fills = [r.attrib["fill"] for r in spans_of(parse(render(tl, "svg")))]
    assert len(set(fills)) == len(PHASES)
    assert FAILED not in fills and WARN not in fills


def test_marks_are_vertical_lines_at_their_time_with_kind_styles_and_labels() -> None:
    tl = timeline()
    root = parse(render(tl, "svg"))
    scale, origin = scale_and_origin(root)
    marks = root.findall(".//s:g[@class='mark']", NS)
    assert [m.attrib["data-kind"] for m in marks] == ["batch", "batch", "stop"]
    lines = []
    for group, mark in zip(marks, tl.marks, strict=True):
        line = group.find("s:line", NS)
        text = group.find("s:text", NS)
        assert line is not None and text is not None
        assert f(line, "x1") == f(line, "x2") == pytest.approx(origin + mark.at * scale, abs=0.02)
        assert f(line, "y2") > f(line, "y1")
        assert text.text == mark.label
        lines.append(line)
    assert lines[0].attrib["stroke"] == lines[1].attrib["stroke"] != FAILED
    assert "stroke-dasharray" in lines[1].attrib, "batch boundaries are dashed"
    assert lines[2].attrib["stroke"] == FAILED and "stroke-dasharray" not in lines[2].attrib


def test_rollback_marks_are_orange() -> None:
    tl = timeline()
    tl.marks.append(Mark(131.0, "rollback", "rollback"))
    root = parse(render(tl, "svg"))
    group = root.findall(".//s:g[@data-kind='rollback']", NS)
    assert len(group) == 1
    line = group[0].find("s:line", NS)
    assert line is not None and line.attrib["stroke"] not in (FAILED, "#808080")


def test_legend_lists_the_phases_used_in_phase_order_and_the_statuses_seen() -> None:
    root = parse(render(timeline(), "svg"))
    items = root.findall(".//s:g[@class='legend']/s:g[@class='legend-item']", NS)
    phases = [i.attrib["data-phase"] for i in items if "data-phase" in i.attrib]
    assert phases == ["hook", "drain", "stop", "load", "ready"]  # gpu-release and rollback unused
    assert [i.attrib["data-status"] for i in items if "data-status" in i.attrib] == ["failed", "warn"]
    swatch = {i.attrib["data-phase"]: i.find("s:rect", NS) for i in items if "data-phase" in i.attrib}
    load = next(r for r in spans_of(root) if r.attrib["data-phase"] == "load")
    assert swatch["load"] is not None and swatch["load"].attrib["fill"] == load.attrib["fill"]


def test_a_clean_rollout_has_no_status_entries_in_the_legend() -> None:
    tl = Timeline()
    tl.spans.append(Span("h u", "load", 0.0, 3.0))
    items = parse(render(tl, "svg")).findall(".//s:g[@class='legend-item']", NS)
    assert [i.attrib.get("data-phase") for i in items] == ["load"]


@pytest.mark.parametrize("last", [0.3, 7.0, 95.0, 130.0, 1234.0])
def test_axis_ticks_are_round_evenly_spaced_and_cover_the_rollout(last: float) -> None:
    tl = Timeline()
    tl.spans.append(Span("h u", "load", 0.0, last))
    ticks = parse(render(tl, "svg")).findall(".//s:text[@class='tick']", NS)
    values = [float(t.attrib["data-seconds"]) for t in ticks]
    assert 4 <= len(values) <= 11
    assert values[0] == 0 and values[-1] >= last
    steps = {round(b - a, 9) for a, b in itertools.pairwise(values)}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1, 2, 5)
    assert [float(t.text or "") for t in ticks] == pytest.approx(values)


def test_user_text_is_escaped_and_the_svg_still_parses() -> None:
    tl = Timeline()
    row = f"{NASTY} ernie-vllm-0.service"
    tl.spans.append(Span(row, "load", 0.0, 5.0))
    tl.marks.append(Mark(1.0, "batch", f"batch {NASTY}"))
    svg = render(tl, "svg", title=f"title {NASTY}")
    assert "<script>" not in svg
    root = parse(svg)
    assert [r.attrib["data-row"] for r in root.findall(".//s:g[@class='row']", NS)] == [row]
    texts = {"".join(t.itertext()) for t in root.iter(f"{{{NS['s']}}}text")}
    assert f"title {NASTY}" in texts and f"batch {NASTY}" in texts
    html = render(tl, "html", title=f"title {NASTY}")
    assert "<script" not in html


def test_characters_xml_cannot_carry_do_not_break_the_file() -> None:
    tl = Timeline()
    tl.spans.append(Span("bad\x01host unit", "load", 0.0, 5.0))
    root = parse(render(tl, "svg"))
    assert len(spans_of(root)) == 1


def test_an_empty_timeline_is_a_valid_svg_that_says_so() -> None:
    root = parse(render(Timeline(), "svg"))
    assert root.tag == f"{{{NS['s']}}}svg"
    assert spans_of(root) == []
    assert "no instance was touched" in {"".join(t.itertext()) for t in root.iter(f"{{{NS['s']}}}text")}
    assert "no instance was touched" in render(Timeline(), "html")


def test_html_is_a_self_contained_page_around_the_same_svg() -> None:
    tl = timeline()
    html = render(tl, "html", title="restart prod")
    assert html.startswith("<!DOCTYPE html>")
    assert render(tl, "svg", title="restart prod") in html
    for external in ("<script", "src=", "href=", "@import", "url("):
        assert external not in html
    assert "<table>" in html and "a10-2 ernie-vllm-0.service" in html


def test_render_rejects_an_unknown_format() -> None:
    with pytest.raises(DeployError, match="png"):
        render(timeline(), "png")


@pytest.mark.parametrize(("name", "fmt"), [("t.svg", "svg"), ("t.html", "html"), ("t.htm", "html"),
                                           ("T.SVG", "svg")])
def test_write_picks_the_format_from_the_suffix(tmp_path: Path, name: str, fmt: str) -> None:
    tl = timeline()
    path = tmp_path / name
    write(tl, path, "restart prod")
    assert path.read_text(encoding="utf-8") == render(tl, fmt, "restart prod")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "no temporary file is left behind"


def test_write_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "t.svg"
    path.write_text("old")
    write(timeline(), path, "")
    parse(path.read_text(encoding="utf-8"))
    assert [p.name for p in tmp_path.iterdir()] == ["t.svg"]


def test_write_rejects_other_suffixes_clearly_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    with pytest.raises(DeployError) as caught:
        write(timeline(), path, "")
    text = str(caught.value)
    assert str(path) in text
    for suffix in (".svg", ".html", ".htm"):
        assert suffix in text
    assert list(tmp_path.iterdir()) == []


def test_write_into_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "t.svg"
    with pytest.raises(DeployError) as caught:
        write(timeline(), path, "")
    assert str(path) in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_phase_is_recorded_once_and_drawn_and_timed_from_its_step() -> None:
    """A readiness watch is one step: it draws loading (from the start) until the instance first served, then
    ready; the timings table reads the same step."""
    tl = Timeline(started_at=1_700_000_000.0)
    unit = "ernie-vllm-0.service"
    drain = Step("drain ernie-vllm-0", StepStatus.WARN, seconds=2.0, phase="drain", units=(unit,), started=1.0,
                 ended=3.0)
    ready = Step("ready ernie-vllm-0", seconds=10.0, phase="ready", units=(unit,), started=4.0, ended=15.0,
                 healthy=12.0)
    for step in (drain, ready):
        tl.record("a", step)
    assert [(s.phase, s.start, s.end, s.status) for s in tl.spans] == [
        ("drain", 1.0, 3.0, "warn"), ("load", 4.0, 12.0, "ok"), ("ready", 12.0, 15.0, "ok")]
    assert phase_timings([drain, ready]) == {unit: {"drain": 2.0, "ready": 10.0, "load": 7.0}}
