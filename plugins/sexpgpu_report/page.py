"""``sexpgpu report``: a run's charts as one self-contained HTML page and PNG images.

The page holds its charts as inline SVG and its style inline: it opens from the
disk, mailed or copied, with no network. Each file is written beside its final
name and renamed over it, so a browser or a ``--watch`` never sees half a page.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sexpgpu_report.listing import EVENTS_FILE, RunRow, read_row
from sexpgpu_report.plots import Rendered, charts_of, render
from sexpgpu_report.series import Drawn, Mark, drawn_marks, read_events, series_of

__all__ = ["Report", "write_report"]

PAGE = "index.html"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 60em;
  color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 1.5em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border-bottom: 1px solid #ddd; padding: 0.2em 0.8em 0.2em 0; text-align: left;
  vertical-align: top; }
figure { margin: 1em 0; } figcaption { font-size: 0.85em; color: #555; }
svg { max-width: 100%; height: auto; }
g.mark:hover path { stroke-width: 4; }
.state-failed { color: #b00; } .state-running { color: #06c; }
pre { margin: 0; white-space: pre-wrap; font-family: inherit; }
"""


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote: the page, the PNGs, and the run's row."""

    page: Path
    images: tuple[Path, ...]
    row: RunRow | None
    charts: int
    marks: int


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _summary(row: RunRow | None) -> str:
    if row is None:
        return "<p>No status file: the run has not written one yet.</p>"
    state = row.state if row.process != "gone" else "running (process gone)"
    steps = f"{row.step} / {row.steps}" if row.steps is not None else str(row.step)
    cells = [
        ("state", f'<span class="state-{html.escape(row.state)}">{html.escape(state)}</span>'),
        ("run file", html.escape(row.file or "-")),
        ("step", html.escape(steps)),
        ("last loss", "-" if row.loss is None else f"{row.loss:.6g}"),
        ("last checkpoint", html.escape(row.checkpoint or "-")),
        ("started", _when(row.started)),
        ("updated", _when(row.updated)),
    ]
    cells += [(html.escape(name), f"{value:.6g}") for name, value in row.evals.items()]
    if row.error:
        cells.append(("error", html.escape(row.error)))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in cells)
    return f"<table>{body}</table>"


def _marks_table(marks: Sequence[Mark]) -> str:
    if not marks:
        return "<p>No annotations yet.</p>"
    rows = "".join(
        f"<tr><td>{m.step}</td><td>{html.escape(m.kind)}</td><td>{_when(m.time)}</td>"
        f"<td><pre>{html.escape(m.text)}</pre></td></tr>"
        for m in marks
    )
    return f"<table><tr><th>step</th><th>kind</th><th>time</th><th>text</th></tr>{rows}</table>"


def _checkpoints_note(marked: Drawn) -> str:
    """What a chart says of its checkpoint marks: nothing unless some are left out."""
    if not marked.thinned:
        return ""
    return f"{marked.checkpoints} of {marked.written} checkpoints marked"


def _page(
    slug: str,
    row: RunRow | None,
    drawn: Sequence[Rendered],
    marks: Sequence[Mark],
    refresh: float,
    marked: Drawn,
) -> str:
    meta = f'<meta http-equiv="refresh" content="{max(1, round(refresh))}">' if refresh else ""
    note = _checkpoints_note(marked)
    said = f' &middot; <span class="checkpoints">{note}</span>' if note else ""
    figures = "".join(
        f'<figure id="chart-{r.chart.key}" data-series="{len(r.chart.series)}">{r.svg}'
        f'<figcaption>{html.escape(r.chart.title)} &middot; <a href="{r.chart.key}.png">'
        f"{r.chart.key}.png</a>{said}</figcaption></figure>"
        for r in drawn
    )
    thinned = (
        f" Of the {marked.written} checkpoints written, {marked.checkpoints} are marked: the "
        "newest, the one the status file names, and the others evenly spread over the run "
        "(which are still stored the events do not say); the table below lists every one."
        if note
        else ""
    )
    made = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"{meta}<title>sexpgpu report: {html.escape(slug)}</title><style>{STYLE}</style>"
        f"</head><body><h1>sexpgpu report: {html.escape(slug)}</h1>"
        f"{_summary(row)}<h2>Charts</h2>"
        "<p>Vertical lines mark annotations (dotted grey: checkpoint, dashed blue: resumed, "
        "orange: interrupted, red: failed, green: done); hover one for its text."
        f"{thinned}</p>"
        f"{figures}<h2>Annotations</h2>{_marks_table(marks)}"
        f"<p><small>Made by sexpgpu report at {made}.</small></p></body></html>\n"
    )


def write_report(folder: Path, out: Path, *, refresh: float = 0.0) -> Report:
    """Read the run in ``folder`` and write ``out/index.html`` and one PNG per chart.

    ``refresh`` (seconds, 0 for none) makes the page reload itself in a browser,
    for a run being watched. Raises :class:`OSError` when ``out`` cannot be written.
    """
    row = read_row(folder)
    series = series_of(read_events(folder / EVENTS_FILE))
    marked = drawn_marks(series.marks, current=row.checkpoint if row is not None else None)
    note = _checkpoints_note(marked)
    drawn = [render(chart, marked.marks, note) for chart in charts_of(series)]
    out.mkdir(parents=True, exist_ok=True)
    images = []
    for rendered in drawn:
        image = out / f"{rendered.chart.key}.png"
        _write(image, rendered.png)
        images.append(image)
    page = out / PAGE
    slug = row.slug if row is not None else folder.name
    _write(page, _page(slug, row, drawn, series.marks, refresh, marked).encode("utf-8"))
    return Report(page, tuple(images), row, len(drawn), len(series.marks))
