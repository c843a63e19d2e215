"""Draw a rollout's timeline as SVG, or as a self-contained HTML page around the same SVG.

Pure string building: the picture has to open anywhere a report is copied to (a ticket, a mail, an
air-gapped bastion), so no scripts, fonts, stylesheets or images are referenced, and no drawing library
becomes a dependency. Every user-supplied string (host names, unit names, mark labels come from
inventories) goes through `_esc`.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from xml.sax.saxutils import escape

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration.timeline import PHASES, Mark, Span, Timeline

FORMATS = {".svg": "svg", ".html": "html", ".htm": "html"}

# Okabe-Ito based, so phases stay apart for the common colour-vision deficiencies; pure red is left out
# because it means "failed", and amber because it means "warning".
PHASE_COLOUR = {
    "hook": "#9b7fd1",
    "balancer": "#f0e442",
    "drain": "#56b4e9",
    "stop": "#8c6d5a",
    "gpu-release": "#cc79a7",
    "load": "#0072b2",
    "ready": "#009e73",
    "rollback": "#e69f00",
}
OTHER_COLOUR = "#b0b0b0"  # a phase this module does not know yet still gets drawn
FAILED = "#d62728"
WARN = "#c98a00"
MARK_STYLE = {  # kind -> (stroke, dash pattern or "")
    "batch": ("#808080", "5 4"),
    "stop": (FAILED, ""),
    "rollback": ("#ff7f0e", ""),
}

# Geometry, in pixels. CHAR_W is an estimate of one character of 12 px sans-serif, used only to size the
# label column and lay out the legend; nothing is measured.
CHAR_W = 7.0
PLOT_W = 800.0
RIGHT_PAD = 48.0
ROW_H = 26.0
BAR_H = 16.0
LABEL_MIN, LABEL_MAX = 80.0, 360.0
PLOT_TOP = 96.0
MIN_BAR_W = 1.0  # a span of (almost) no duration, such as a hook that failed at once, must stay visible

# XML 1.0 cannot carry these even as character references; one in a host name would make the file unreadable.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _esc(text: str) -> str:
    """Text for element content and double- or single-quoted attributes alike."""
    return escape(_NOT_XML.sub("\ufffd", text), {'"': "&quot;", "'": "&apos;"})


def _n(value: float) -> str:
    """A coordinate: short, and without '-0'."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _s(seconds: float) -> str:
    return f"{seconds:.2f}"


def _tick_step(span: float) -> float:
    """1, 2 or 5 times a power of ten, giving about 5 to 10 ticks over `span` seconds."""
    raw = span / 8
    power = 10.0 ** math.floor(math.log10(raw))
    for factor in (1.0, 2.0, 5.0, 10.0):
        if raw <= factor * power:
            return factor * power
    return 10.0 * power


def _tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def _phases_used(spans: Sequence[Span]) -> list[str]:
    seen = {s.phase for s in spans}
    known = [p for p in PHASES if p in seen]
    return known + [p for p in dict.fromkeys(s.phase for s in spans) if p not in PHASES]


def _fit(label: str, chars: int) -> str:
    """Shorten in the middle: a row label is "host unit", and both ends tell rows apart."""
    if len(label) <= chars:
        return label
    head = (chars - 1) // 2
    return label[:head] + "…" + label[len(label) - (chars - 1 - head):]


def _heading(timeline: Timeline, title: str) -> tuple[str, str]:
    started = datetime.fromtimestamp(timeline.started_at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return title or "Rollout timeline", f"started {started}"


def _empty_svg(heading: str, sub: str) -> str:
    width, height = 520, 110
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" font-family="system-ui, sans-serif" font-size="12">',
        f"<title>{_esc(heading)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="16" y="26" font-size="16" font-weight="bold">{_esc(heading)}</text>',
        f'<text x="16" y="46" fill="#555555">{_esc(sub)}</text>',
        '<text class="empty" x="16" y="82" font-size="14">no instance was touched</text>',
        "</svg>",
    ]) + "\n"


def render_svg(timeline: Timeline, title: str = "") -> str:
    heading, sub = _heading(timeline, title)
    spans = list(timeline.spans)
    rows = timeline.rows
    if not rows:
        return _empty_svg(heading, sub)

    marks = sorted(timeline.marks, key=lambda m: m.at)
    last = max([s.end for s in spans] + [s.start for s in spans] + [m.at for m in marks])
    step = _tick_step(last if last > 0 else 1.0)
    axis_end = max(step, math.ceil(last / step - 1e-9) * step)  # the axis ends on a round number
    longest = max(len(r) for r in rows)
    label_w = min(LABEL_MAX, max(LABEL_MIN, longest * CHAR_W + 24))
    label_chars = int((label_w - 24) / CHAR_W)
    left = label_w
    scale = PLOT_W / axis_end
    width = left + PLOT_W + RIGHT_PAD
    bottom = PLOT_TOP + len(rows) * ROW_H

    def x_of(t: float) -> float:
        return left + max(0.0, t) * scale

    out: list[str] = []
    add = out.append

    # Legend first, since its height decides the picture's height.
    legend: list[tuple[str, str, str, str]] = []  # (data attribute, value, swatch drawn at 0,0, label)
    for phase in _phases_used(spans):
        colour = PHASE_COLOUR.get(phase, OTHER_COLOUR)
        legend.append(("phase", phase, f'<rect x="0" y="-10" width="14" height="12" fill="{colour}"/>', phase))
    statuses = {s.status for s in spans}
    if "failed" in statuses:
        legend.append(("status", "failed", f'<rect x="0" y="-10" width="14" height="12" fill="#ffffff" '
                       f'stroke="{FAILED}" stroke-width="2.5"/>', "failed"))
    if "warn" in statuses:
        legend.append(("status", "warn", f'<rect x="0" y="-10" width="14" height="12" fill="#ffffff" '
                       f'stroke="{WARN}" stroke-width="2" stroke-dasharray="3 2"/>', "warning"))
    legend_items: list[str] = []
    lx, ly = 0.0, 0.0
    for attribute, value, swatch, label in legend:
        item_w = 22 + len(label) * CHAR_W + 18
        if lx and lx + item_w > width - 32:
            lx, ly = 0.0, ly + 20
        legend_items.append(
            f'<g class="legend-item" data-{attribute}="{_esc(value)}" transform="translate({_n(lx)},{_n(ly)})">'
            f'{swatch}<text x="20" y="0">{_esc(label)}</text></g>')
        lx += item_w
    legend_top = bottom + 62
    height = legend_top + ly + 18

    add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(width)}" height="{_n(height)}" '
        f'viewBox="0 0 {_n(width)} {_n(height)}" role="img" font-family="system-ui, sans-serif" font-size="12">')
    add(f"<title>{_esc(heading)}</title>")
    add(f'<rect x="0" y="0" width="{_n(width)}" height="{_n(height)}" fill="#ffffff"/>')
    add(f'<text x="16" y="26" font-size="16" font-weight="bold">{_esc(heading)}</text>')
    add(f'<text x="16" y="46" fill="#555555">{_esc(sub)}, {len(rows)} instance(s), {_s(last)} s</text>')

    # Grid and axis under the bars, so the bars stay readable.
    add('<g class="axis">')
    ticks = round(axis_end / step)
    for i in range(ticks + 1):
        t = i * step
        tx = _n(x_of(t))
        add(f'<line x1="{tx}" x2="{tx}" y1="{_n(PLOT_TOP)}" y2="{_n(bottom)}" stroke="#e6e6e6"/>')
        add(f'<line x1="{tx}" x2="{tx}" y1="{_n(bottom)}" y2="{_n(bottom + 5)}" stroke="#333333"/>')
        add(f'<text class="tick" x="{tx}" y="{_n(bottom + 18)}" text-anchor="middle" '
            f'data-seconds="{_n(t)}">{_tick_label(t, step)}</text>')
    add(f'<line x1="{_n(left)}" x2="{_n(left + PLOT_W)}" y1="{_n(bottom)}" y2="{_n(bottom)}" stroke="#333333"/>')
    add(f'<text x="{_n(left + PLOT_W / 2)}" y="{_n(bottom + 36)}" text-anchor="middle" fill="#555555">'
        "seconds since the rollout began</text>")
    add("</g>")

    by_row: dict[str, list[Span]] = {r: [] for r in rows}
    for s in spans:
        by_row[s.row].append(s)
    for index, row in enumerate(rows):
        top = PLOT_TOP + index * ROW_H
        add(f'<g class="row" data-row="{_esc(row)}">')
        if index % 2:
            add(f'<rect class="row-bg" x="0" y="{_n(top)}" width="{_n(width)}" height="{_n(ROW_H)}" '
                'fill="#f4f4f4" fill-opacity="0.6"/>')
        add(f'<text class="row-label" x="{_n(left - 10)}" y="{_n(top + ROW_H / 2 + 4)}" text-anchor="end">'
            f"<title>{_esc(row)}</title>{_esc(_fit(row, label_chars))}</text>")
        for s in by_row[row]:
            x = x_of(s.start)
            w = max(MIN_BAR_W, (s.end - s.start) * scale)
            fill = PHASE_COLOUR.get(s.phase, OTHER_COLOUR)
            if s.status == "failed":
                stroke = f'stroke="{FAILED}" stroke-width="2.5"'
            elif s.status == "warn":
                stroke = f'stroke="{WARN}" stroke-width="2" stroke-dasharray="3 2"'
            else:
                stroke = 'stroke="#ffffff" stroke-width="0.5"'  # adjacent phases stay apart
            tip = f"{s.phase}, {_s(s.start)}–{_s(s.end)} s, {s.status}"
            add(f'<rect class="span" data-phase="{_esc(s.phase)}" data-status="{_esc(s.status)}" '
                f'x="{_n(x)}" y="{_n(top + (ROW_H - BAR_H) / 2)}" width="{_n(w)}" height="{_n(BAR_H)}" '
                f'fill="{fill}" {stroke}><title>{_esc(tip)}</title></rect>')
        add("</g>")

    # Marks over the bars: a stop or rollback line must not hide behind a span.
    add('<g class="marks">')
    for i, m in enumerate(marks):
        out.extend(_mark(m, x_of(m.at), PLOT_TOP - 22 + (i % 2) * 14, bottom, width))
    add("</g>")

    add(f'<g class="legend" transform="translate(16,{_n(legend_top)})">')
    out.extend(legend_items)
    add("</g>")
    add("</svg>")
    return "\n".join(out) + "\n"


def _mark(m: Mark, x: float, label_y: float, bottom: float, width: float) -> list[str]:
    colour, dash = MARK_STYLE.get(m.kind, ("#555555", ""))
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    # A mark near the end (the stop of a failed rollout usually is) would run its label off the picture.
    if x + 3 + len(m.label) * CHAR_W > width - 4:
        label = f'<text x="{_n(x - 3)}" y="{_n(label_y)}" fill="{colour}" font-size="11" text-anchor="end">'
    else:
        label = f'<text x="{_n(x + 3)}" y="{_n(label_y)}" fill="{colour}" font-size="11">'
    # Labels alternate between two lines (label_y) so marks close in time stay legible.
    return [
        f'<g class="mark" data-kind="{_esc(m.kind)}" data-at="{_n(m.at)}">',
        f"<title>{_esc(f'{m.label} at {_s(m.at)} s')}</title>",
        f'<line x1="{_n(x)}" x2="{_n(x)}" y1="{_n(label_y + 4)}" y2="{_n(bottom)}" stroke="{colour}" '
        f'stroke-width="1.5"{dashed}/>',
        f"{label}{_esc(m.label)}</text>",
        "</g>",
    ]


def render_html(timeline: Timeline, title: str = "") -> str:
    heading, sub = _heading(timeline, title)
    spans = list(timeline.spans)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>{_esc(heading)}</title>",
        "<style>",
        "body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }",
        "table { border-collapse: collapse; margin: 0.5em 0 1.5em; }",
        "th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }",
        "td.num { text-align: right; font-variant-numeric: tabular-nums; }",
        ".swatch { display: inline-block; width: 1em; height: 1em; vertical-align: middle; }",
        ".failed { color: #d62728; font-weight: bold; } .warn { color: #a06e00; }",
        "svg { max-width: 100%; height: auto; }",
        "</style>",
        "</head>",
        "<body>",
        f"<h1>{_esc(heading)}</h1>",
        f"<p>{_esc(sub)}</p>",
        render_svg(timeline, title),
    ]
    if spans:
        parts += _phase_table(spans) + _instance_table(timeline) + _mark_table(timeline.marks)
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def _phase_table(spans: Sequence[Span]) -> list[str]:
    lines = ["<h2>Phases</h2>", "<table>",
             "<tr><th>phase</th><th>spans</th><th>total s</th><th>longest s</th></tr>"]
    for phase in _phases_used(spans):
        durations = [s.end - s.start for s in spans if s.phase == phase]
        colour = PHASE_COLOUR.get(phase, OTHER_COLOUR)
        lines.append(f'<tr><td><span class="swatch" style="background: {colour}"></span> {_esc(phase)}</td>'
                     f'<td class="num">{len(durations)}</td><td class="num">{_s(sum(durations))}</td>'
                     f'<td class="num">{_s(max(durations))}</td></tr>')
    return [*lines, "</table>"]


def _instance_table(timeline: Timeline) -> list[str]:
    lines = ["<h2>Instances</h2>", "<table>",
             "<tr><th>instance</th><th>from s</th><th>to s</th><th>phases (s)</th><th>status</th></tr>"]
    for row in timeline.rows:
        mine = [s for s in timeline.spans if s.row == row]
        statuses = {s.status for s in mine}
        status = "failed" if "failed" in statuses else "warn" if "warn" in statuses else "ok"
        phases = ", ".join(f"{s.phase} {s.end - s.start:.1f}" for s in mine)
        lines.append(f"<tr><td>{_esc(row)}</td><td class=\"num\">{_s(min(s.start for s in mine))}</td>"
                     f"<td class=\"num\">{_s(max(s.end for s in mine))}</td><td>{_esc(phases)}</td>"
                     f'<td class="{status}">{status}</td></tr>')
    return [*lines, "</table>"]


def _mark_table(marks: Sequence[Mark]) -> list[str]:
    if not marks:
        return []
    lines = ["<h2>Marks</h2>", "<table>", "<tr><th>at s</th><th>kind</th><th>label</th></tr>"]
    for m in sorted(marks, key=lambda m: m.at):
        lines.append(f'<tr><td class="num">{_s(m.at)}</td><td>{_esc(m.kind)}</td><td>{_esc(m.label)}</td></tr>')
    return [*lines, "</table>"]


def render(timeline: Timeline, fmt: str, title: str = "") -> str:
    if fmt == "svg":
        return render_svg(timeline, title)
    if fmt == "html":
        return render_html(timeline, title)
    raise DeployError(f"unknown timeline format {fmt!r}", hint="use svg or html")


def write(timeline: Timeline, path: Path, title: str = "") -> None:
    """Write the picture, its format chosen by the file's suffix; readers never see a half-written file."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        accepted = ", ".join(FORMATS)
        raise DeployError(f"cannot tell the timeline format from the suffix {path.suffix or '(none)'!r}",
                          where=str(path), hint=f"name the file with one of {accepted}")
    text = render(timeline, fmt, title)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise DeployError(f"cannot write the timeline: {exc.strerror}", where=str(path),
                          hint="choose a writable directory that exists") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; a report is meant to be read by others (a web server, a colleague).
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise DeployError(f"cannot write the timeline: {exc.strerror}", where=str(path),
                          hint="choose a writable directory that exists") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
