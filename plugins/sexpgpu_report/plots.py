"""The report's charts, drawn by matplotlib: a PNG file and an SVG for the page each.

Each curve is an SVG group of class ``series`` (id ``<chart>-series-<n>``) and each
annotation a vertical line in a group of class ``mark`` (``<chart>-mark-<n>``) that holds a ``<title>`` (its text, shown on hover), so a
browser, a test or a script can find them. No pyplot: figures are made and
dropped without matplotlib's global state.
"""

from __future__ import annotations

import hashlib
import html
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sexpgpu_report.fields import drawable
from sexpgpu_report.series import Mark, RunSeries

__all__ = ["Chart", "charts_of", "render"]

MARK_STYLE = {
    "checkpoint": ("#7f7f7f", ":"),
    "resumed": ("#1f77b4", "--"),
    "interrupted": ("#ff7f0e", "-"),
    "failed": ("#d62728", "-"),
    "done": ("#2ca02c", "-"),
    "note": ("#9467bd", ":"),
}
"""Annotation kind -> (colour, line style) of its mark."""

SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
SIZE = (7.5, 3.0)  # inches at DPI: 750 x 300 pixels
DPI = 100
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)


@dataclass(frozen=True)
class Chart:
    """One chart: a ``key`` (its file name's stem), a title, the y label and its series."""

    key: str
    title: str
    ylabel: str
    series: tuple[tuple[str, tuple[tuple[int, float], ...]], ...]


@dataclass(frozen=True)
class Rendered:
    """A chart drawn: its PNG bytes and the SVG text for the page."""

    chart: Chart
    png: bytes
    svg: str


MOST_POINTS = 4000
"""A curve longer than this is drawn from the highest and lowest point (and any gap)
of each of ``MOST_POINTS // 2`` runs of steps: the same picture at a chart's width,
for a fraction of the page."""


def thinned(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """``points`` (by step) as drawn: all of them, or a long curve's extremes per run
    of steps, in step order (see :data:`MOST_POINTS`)."""
    if len(points) <= MOST_POINTS:
        return tuple(points)
    buckets = MOST_POINTS // 2
    kept: list[tuple[int, float]] = []
    for b in range(buckets):
        low = high = gap = None
        for point in points[b * len(points) // buckets : (b + 1) * len(points) // buckets]:
            if drawable(point[1]) is None:
                gap = gap or point  # a gap stays a gap
            else:
                low = point if low is None or point[1] < low[1] else low
                high = point if high is None or point[1] > high[1] else high
        kept.extend(sorted({p for p in (low, high, gap) if p is not None}))
    return tuple(kept)


def charts_of(series: RunSeries) -> list[Chart]:
    """The charts of a run: loss, learning rate, throughput, then one per eval metric."""

    def one(key: str, title: str, ylabel: str, points: Sequence[tuple[int, float]]) -> Chart:
        return Chart(key, title, ylabel, ((ylabel, thinned(points)),))

    charts = [one("loss", "training loss", "loss", series.curves.get("loss", ()))]
    if "lr" in series.curves:
        charts.append(one("lr", "learning rate", "lr", series.curves["lr"]))
    if series.throughput is not None:
        label, points = series.throughput
        charts.append(one("throughput", f"throughput ({label})", label, points))
    for name, by_source in series.evals.items():
        charts.append(
            Chart(
                key=_eval_key(name),
                title=f"eval {name}",
                ylabel=name,
                series=tuple((source, thinned(points)) for source, points in by_source.items()),
            )
        )
    return charts


def _eval_key(name: str) -> str:
    """A chart's file stem and id prefix for an eval metric: its name with what a file
    name or an id cannot hold replaced, and where anything was, a short hash of the
    name, so ``probe/a+b`` and ``probe/a*b`` stay two charts."""
    safe = _SAFE.sub("-", name)
    if safe != name.replace("/", "-"):
        safe += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return "eval-" + safe


def _finite(value: float) -> float:
    # NaN, infinite or beyond a chart's range (which would overflow): drawn as a gap
    found = drawable(value)
    return math.nan if found is None else found


def _plain(label: str) -> str:
    """``label`` as matplotlib draws it literally: a ``$`` would start math markup."""
    return label.replace("$", r"\$")


def _figure(chart: Chart, marks: Sequence[Mark], note: str):  # type: ignore[no-untyped-def]
    from matplotlib.figure import Figure

    figure = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(_plain(chart.title), loc="left", fontsize=10)
    if note:
        axes.set_title(_plain(note), loc="right", fontsize=8, color="#555555")
    axes.set_xlabel("step")
    axes.set_ylabel(_plain(chart.ylabel))
    axes.grid(True, alpha=0.3)
    drawn = 0
    for index, (label, points) in enumerate(chart.series):
        steps = [step for step, _ in points]
        values = [_finite(value) for _, value in points]
        # one point alone is invisible as a line: give it a dot
        style = "o-" if len(points) < 50 else "-"
        (line,) = axes.plot(
            steps,
            values,
            style,
            markersize=3,
            linewidth=1.3,
            color=SERIES_COLOURS[index % len(SERIES_COLOURS)],
            label=_plain(label),
        )
        line.set_gid(f"{chart.key}-series-{index}")
        drawn += len(points)
    for index, mark in enumerate(marks):
        colour, style = MARK_STYLE.get(mark.kind, MARK_STYLE["note"])
        line = axes.axvline(mark.step, color=colour, linestyle=style, linewidth=1.5, alpha=0.8)
        line.set_gid(f"{chart.key}-mark-{index}")
    if len(chart.series) > 1:
        axes.legend(loc="best", fontsize=8)
    if not drawn:
        axes.text(0.5, 0.5, "no points yet", ha="center", va="center", transform=axes.transAxes)
    return figure


def _titled(svg: str, key: str, series: int, marks: Sequence[Mark]) -> str:
    """``svg`` with each mark's text as the ``<title>`` of its group (the hover text),
    classes to find the curves and marks by, and no metadata block."""
    for index, mark in enumerate(marks):
        tag = f'<g id="{key}-mark-{index}">'
        title = f"<title>step {mark.step}: {html.escape(mark.text, quote=False)}</title>"
        svg = svg.replace(tag, f'{tag[:-1]} class="mark mark-{mark.kind}">{title}', 1)
    for index in range(series):
        tag = f'<g id="{key}-series-{index}">'
        svg = svg.replace(tag, f'{tag[:-1]} class="series">', 1)
    return _prefixed(_METADATA.sub("", svg, count=1), key)


def _prefixed(svg: str, key: str) -> str:
    """Every id of ``svg`` (and every reference to one) starting with ``<key>-``: a
    page holds several charts, and an id may appear once in it."""
    mine = re.escape(f"{key}-")
    svg = re.sub(rf'\bid="(?!{mine})', f'id="{key}-', svg)
    return re.sub(rf'(url\(#|href="#)(?!{mine})', lambda m: f"{m.group(1)}{key}-", svg)


def render(chart: Chart, marks: Sequence[Mark], note: str = "") -> Rendered:
    """Draw ``chart`` with ``marks`` on its step axis, as PNG and as SVG; ``note``, when
    given, above its top right corner (how many checkpoints are marked)."""
    import matplotlib

    # "none": text stays text in the SVG (small, selectable); the salt and the
    # absent date make the same run give the same page.
    # One salt per chart: the ids matplotlib makes stay unique on a page of several.
    salt = f"sexpgpu-{chart.key}"
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        figure = _figure(chart, marks, note)
        png, svg = io.BytesIO(), io.StringIO()
        figure.savefig(png, format="png", metadata={"Software": None})
        figure.savefig(svg, format="svg", metadata={"Date": None, "Creator": None})
    text = svg.getvalue()
    text = text[text.index("<svg") :]  # the page takes the element, not the XML prolog
    return Rendered(chart, png.getvalue(), _titled(text, chart.key, len(chart.series), marks))
