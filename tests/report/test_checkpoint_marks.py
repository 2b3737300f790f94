"""A long run's checkpoint marks: at most 20 per chart (the newest, the one the status
file names, the rest evenly spread), the caption saying how many of how many; a
short run's every checkpoint marked as it always was. The runs are forged in the
format a run writes (an ``events.jsonl`` and a ``status.json``), nothing trained."""

from __future__ import annotations

import json
import re
from pathlib import Path

from sexpgpu_report.page import write_report
from sexpgpu_report.series import Mark

NOW = 1_796_216_176.0
# a chart's mark as the page holds it: <g id="loss-mark-3" class="mark mark-checkpoint">
# <title>step 300: checkpoint ck/step-00000300</title>
MARK = re.compile(r'<g id="([\w.-]+?)-mark-\d+" class="mark mark-(\w+)"><title>step (\d+): ')


def _location(step: int) -> str:
    return f"/ck/lm/step-{step:08d}"


def _run(root: Path, steps: int, checkpoints: list[int], extra: list[dict]) -> Path:
    """A finished run of ``steps`` with a checkpoint annotation at each of ``checkpoints``
    (as the checkpointer writes it) and the ``extra`` annotations, in step order."""
    folder = root / "lm-0a1b2c"
    folder.mkdir(parents=True)
    events: list[dict] = []
    for step in range(1, steps + 1):
        events.append({"kind": "point", "id": f"l{step}", "experiment": "lm-0a1b2c",
                       "step": step, "time": NOW + step, "name": "loss",
                       "value": 2.0 / step})  # fmt: skip
    for step in checkpoints:
        events.append({"kind": "annotation", "id": f"c{step}", "experiment": "lm-0a1b2c",
                       "step": step, "time": NOW + step + 0.5,
                       "text": f"checkpoint {_location(step)}", "seconds": 0.01,
                       "blocked": 0.001})  # fmt: skip
    events += extra
    events.append({"kind": "done", "id": "d", "step": steps, "time": NOW + steps + 1})
    events.sort(key=lambda e: e["time"])
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    status = {"state": "finished", "summary": "finished", "error": None, "step": steps,
              "steps": steps, "checkpoint": _location(checkpoints[-1]), "slug": "lm-0a1b2c",
              "updated": NOW + steps + 1, "run": "lm", "file": "/runs/lm.sx",
              "pid": 4242, "host": "elsewhere", "started": NOW}  # fmt: skip
    (folder / "status.json").write_text(json.dumps(status))
    return folder


def _marks_by_chart(page: str) -> dict[str, list[tuple[str, int]]]:
    charts: dict[str, list[tuple[str, int]]] = {}
    for chart, kind, step in MARK.findall(page):
        charts.setdefault(chart, []).append((kind, int(step)))
    return charts


def _annotation(ident: str, step: int, text: str, after: float = 0.7) -> dict:
    return {"kind": "annotation", "id": ident, "experiment": "lm-0a1b2c", "step": step,
            "time": NOW + step + after, "text": text}  # fmt: skip


def test_a_long_run_marks_at_most_20_of_its_134_checkpoints_and_says_so(tmp_path: Path):
    # :checkpoint-every 100 and :keep-last 3 over 13,400 steps: 134 checkpoints
    # written, 131 of them deleted since; stopped by SIGTERM at 6,700 and resumed
    checkpoints = list(range(100, 13_401, 100))
    extra = [
        _annotation("i", 6_700, "interrupted by SIGTERM at step 6700", after=0.2),
        _annotation("r", 6_700, f"resumed from {_location(6_700)}", after=0.9),
    ]
    folder = _run(tmp_path, 13_400, checkpoints, extra)
    report = write_report(folder, tmp_path / "out")
    page = report.page.read_text()
    charts = _marks_by_chart(page)
    assert set(charts) == {"loss"}, set(charts)
    for chart, marks in charts.items():
        marked = [step for kind, step in marks if kind == "checkpoint"]
        assert len(marked) == 20, (chart, marked)
        # the newest (the status file's) and the oldest, the rest evenly spread
        assert marked[0] == 100 and marked[-1] == 13_400, marked
        gaps = {b - a for a, b in zip(marked, marked[1:], strict=False)}
        assert max(gaps) - min(gaps) <= 100, gaps
        # interrupted, resumed and done are marked as ever
        others = [(kind, step) for kind, step in marks if kind != "checkpoint"]
        assert others == [("interrupted", 6_700), ("resumed", 6_700), ("done", 13_400)], others
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    assert captions and all("20 of 134 checkpoints marked" in c for c in captions), captions
    assert "Of the 134 checkpoints written, 20 are marked" in page
    # the PNG says it too (the SVG's text is the same drawing's)
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert svgs and all(">20 of 134 checkpoints marked</text>" in svg for svg in svgs)
    # the table still lists every annotation
    assert report.marks == 134 + 3
    assert all(f"<pre>checkpoint {_location(s)}</pre>" in page for s in checkpoints)


def test_a_short_run_marks_its_3_checkpoints_as_before(tmp_path: Path):
    folder = _run(tmp_path, 30, [10, 20, 30], [])
    page = write_report(folder, tmp_path / "out").page.read_text()
    charts = _marks_by_chart(page)
    assert charts == {"loss": [("checkpoint", 10), ("checkpoint", 20), ("checkpoint", 30),
                               ("done", 30)]}  # fmt: skip
    assert "checkpoints marked" not in page and "checkpoints written" not in page


def _marks(*steps: int) -> list[Mark]:
    return [Mark(step, "checkpoint", f"checkpoint {_location(step)}", NOW + step) for step in steps]


def test_the_status_files_checkpoint_and_each_location_once_are_marked():
    from sexpgpu_report.series import MOST_CHECKPOINT_MARKS, drawn_marks

    marks = _marks(*range(100, 13_401, 100))
    # the status file names one the even spread passes over (a resume from it)
    drawn = drawn_marks(marks, current=_location(6_700))
    steps = [m.step for m in drawn.marks]
    assert len(steps) == MOST_CHECKPOINT_MARKS == 20
    assert 6_700 in steps and steps[-1] == 13_400 and steps == sorted(steps)
    assert (drawn.checkpoints, drawn.written, drawn.thinned) == (20, 134, True)
    # a step written again after a resume is one checkpoint, marked once, the later
    again = _marks(*range(1, 31), *range(20, 31))
    drawn = drawn_marks(again)
    assert (drawn.checkpoints, drawn.written, drawn.thinned) == (20, 30, True)
    assert len({m.step for m in drawn.marks}) == 20
    assert drawn.marks[-1] is again[-1]
    # a status file naming a checkpoint the stream does not have changes nothing
    assert drawn_marks(again, current="/elsewhere").marks == drawn.marks
    # at most the cap is drawn, and a cap of 1 draws the newest
    assert [m.step for m in drawn_marks(marks, most=1).marks] == [13_400]
    assert drawn_marks(marks, current=_location(100), most=1).checkpoints == 1
