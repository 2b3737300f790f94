"""A run's events as the curves and marks a report draws.

A resumed run appends to the same ``events.jsonl``, and the steps it ran again
after its last checkpoint are reported twice: the later point of a name at a
step is the one of the run that went on, so each name is one curve. An event
delivered twice (at least once delivery) is counted once, by its ``id``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sexpgpu_report.fields import number, open_regular, seconds, text, whole

__all__ = ["Drawn", "Mark", "RunSeries", "drawn_marks", "read_events", "series_of"]

# How an annotation's first line is told apart: the kind of mark it is.
CHECKPOINT_PREFIX = "checkpoint "
MARK_KINDS = (
    (CHECKPOINT_PREFIX, "checkpoint"),
    ("resumed from ", "resumed"),
    ("interrupted by ", "interrupted"),
    ("failed: ", "failed"),
)
TRAIN_CURVES = ("loss", "lr")
THROUGHPUT_COUNTERS = ("tokens", "records")


MOST_MARK_TEXT = 2000
"""The characters of an annotation a report shows (each chart's hover text and the
table hold it: a long one is cut there, whole in ``events.jsonl``)."""


def cut(text: str) -> str:
    """``text`` as a report shows it: at most :data:`MOST_MARK_TEXT` characters, and
    what was left out said."""
    if len(text) <= MOST_MARK_TEXT:
        return text
    return f"{text[:MOST_MARK_TEXT]}... ({len(text) - MOST_MARK_TEXT} more characters)"


@dataclass(frozen=True)
class Mark:
    """An annotation on the step axis: its ``kind`` (``checkpoint``, ``resumed``,
    ``interrupted``, ``failed``, ``done`` or ``note``) and its whole text."""

    step: int
    kind: str
    text: str
    time: float


MOST_CHECKPOINT_MARKS = 20
"""The most checkpoint marks a chart draws: a long run's hundreds would grey it out."""


@dataclass(frozen=True)
class Drawn:
    """The marks a chart draws of a run's: every one but checkpoints past
    :data:`MOST_CHECKPOINT_MARKS`, and how many checkpoints were marked of how many
    the run wrote (distinct locations)."""

    marks: tuple[Mark, ...]
    checkpoints: int
    written: int

    @property
    def thinned(self) -> bool:
        return self.checkpoints < self.written


def _location(mark: Mark) -> str:
    """The location a ``checkpoint <location>`` mark names (its first line)."""
    return mark.text.removeprefix(CHECKPOINT_PREFIX).split("\n", 1)[0]


def _spread(count: int, slots: int) -> list[int]:
    """``slots`` indices of ``range(count)``, evenly spread, the first and last among them."""
    if slots >= count:
        return list(range(count))
    if slots <= 1:
        return [count - 1][:slots]
    return [round(i * (count - 1) / (slots - 1)) for i in range(slots)]


def drawn_marks(
    marks: Sequence[Mark], *, current: str | None = None, most: int = MOST_CHECKPOINT_MARKS
) -> Drawn:
    """The marks of ``marks`` a chart draws, in their order.

    A run of at most ``most`` checkpoint marks has every mark drawn. A longer one
    has each checkpoint location once (the later of a step written again), and of
    those ``most``: the newest, the run's ``current`` one (``status.json``'s
    ``checkpoint``) and the rest evenly spread over the run. Every other kind of
    mark is always drawn. The stream says nothing of retention (a deletion is a log
    line, not an event), so which checkpoints are still stored is not known here.
    """
    checkpoints = [i for i, mark in enumerate(marks) if mark.kind == "checkpoint"]
    if len(checkpoints) <= most:
        return Drawn(tuple(marks), len(checkpoints), len(checkpoints))
    latest: dict[str, int] = {}  # location -> index of its last mark
    for i in checkpoints:
        latest[_location(marks[i])] = i
    written = len(latest)
    ordered = sorted(latest.values(), key=lambda i: (marks[i].step, i))  # the newest last
    chosen = _spread(len(ordered), most)
    at = ordered.index(latest[current]) if current is not None and current in latest else None
    if at is not None and at not in chosen and len(chosen) > 1:
        # the current one takes the place of the nearest one chosen, never the newest's
        nearest = min(chosen[:-1], key=lambda j: abs(j - at))
        chosen[chosen.index(nearest)] = at
    kept = {ordered[j] for j in chosen}
    drawn = tuple(m for i, m in enumerate(marks) if m.kind != "checkpoint" or i in kept)
    return Drawn(drawn, len(kept), written)


@dataclass
class RunSeries:
    """Everything a report draws of one run."""

    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Training points by name (``loss``, ``lr``, ``tokens``), one value per step, by step."""
    evals: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    """Eval metric (``probe/accuracy``) -> source (``run`` or ``evaluate``) -> points by step."""
    throughput: tuple[str, list[tuple[int, float]]] | None = None
    """(``tokens/s`` or ``records/s``, points): the counter's rate between two reports
    of one process (a resume's gap is not counted)."""
    marks: list[Mark] = field(default_factory=list)
    events: int = 0


class UnreadableEvents(OSError):
    """A run's ``events.jsonl`` that cannot be read, or is no regular file."""


MOST_LINE = 1024 * 1024
"""The longest event line read (a point is about 200 bytes): a longer one is skipped."""


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of an ``events.jsonl``, skipping a torn, foreign or over-long line.
    A missing file has none; one that cannot be read or is no regular file (a FIFO,
    a device) raises :class:`UnreadableEvents`."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnreadableEvents(f"{path}: {exc.strerror or exc}") from None
    with f:
        while raw := f.readline(MOST_LINE + 1):
            if len(raw) > MOST_LINE and not raw.endswith(b"\n"):
                while (rest := f.readline(MOST_LINE)) and not rest.endswith(b"\n"):
                    pass  # skip the rest of the line, a piece at a time
                continue
            try:
                event = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(event, dict) and "kind" in event:
                yield event


def _mark(event: Mapping[str, Any], step: int) -> Mark:
    done = event.get("kind") == "done"
    said = text(event.get("text")) or ("done" if done else "")
    kind = "done" if done else "note"
    for prefix, name in MARK_KINDS:
        if said.startswith(prefix):
            kind = name
            break
    return Mark(step, kind, cut(said), seconds(event.get("time")) or 0.0)


def _rate(points: list[tuple[int, float, float, int]], window: int = 10) -> list[tuple[int, float]]:
    """Counter (step, value, time, segment) -> its rate per second over the last
    ``window`` reports of one segment (one process: a resume starts a new one), so
    one slow step does not make the curve a comb."""
    rates = []
    first = 0  # the index where the current segment starts
    for index, (step, value, when, segment) in enumerate(points):
        if segment != points[first][3] or step <= points[index - 1][0]:
            first = index
        back = points[max(first, index - window)]
        seconds = when - back[2]
        if index > first and seconds > 0 and math.isfinite(value - back[1]):
            rates.append((step, (value - back[1]) / seconds))
    return rates


def series_of(events: Iterable[Mapping[str, Any]]) -> RunSeries:
    """The curves, eval points and marks of a run's events (see the module's doc)."""
    out = RunSeries()
    seen: set[str] = set()
    train: dict[str, dict[int, float]] = {}
    evals: dict[str, dict[str, dict[int, float]]] = {}
    counters: dict[str, list[tuple[int, float, float, int]]] = {}
    segment = 0
    for event in events:
        ident = event.get("id")
        if isinstance(ident, str):
            if ident in seen:
                continue
            seen.add(ident)
        out.events += 1
        kind = event.get("kind")
        step = whole(event.get("step", 0))
        if step is None:
            continue  # no step a run writes: nothing to place it at
        if kind in ("annotation", "done"):
            mark = _mark(event, step)
            out.marks.append(mark)
            segment += mark.kind == "resumed"
            continue
        if kind != "point":
            continue
        name, value = text(event.get("name")), number(event.get("value"))
        if name is None or value is None:
            continue
        if "/" in name:
            source = "evaluate" if event.get("source") == "evaluate" else "run"
            evals.setdefault(name, {}).setdefault(source, {})[step] = value
            continue
        train.setdefault(name, {})[step] = value  # a later point of a step wins
        if name in THROUGHPUT_COUNTERS:
            when = seconds(event.get("time"))
            if when is not None:
                counters.setdefault(name, []).append((step, value, when, segment))
    out.curves = {name: sorted(points.items()) for name, points in train.items()}
    out.evals = {
        name: {source: sorted(points.items()) for source, points in sorted(by_source.items())}
        for name, by_source in sorted(evals.items())
    }
    for counter in THROUGHPUT_COUNTERS:
        if counter in counters:
            # a step run again after a resume: the rate of the run that went on
            out.throughput = (f"{counter}/s", sorted(dict(_rate(counters[counter])).items()))
            break
    return out
