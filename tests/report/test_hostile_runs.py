"""`sexpgpu runs` and `sexpgpu report` on forged status and event files, and on odd
names a real run accepts: a bad run folder costs its own row or point, never a
traceback, a hang, all of memory, or the rest of the listing.

The run folders are written by hand, in the format a run writes (a real run's is
compared in tests/report/test_runs.py); the listing is read once through the
console script in a subprocess, as a user runs it, and the reports in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import run_sexpgpu, sexpgpu_in_process

NOW = 1_796_216_176.0


def _status(slug: str, **fields: object) -> dict:
    return {
        "state": "finished",
        "error": None,
        "step": 4,
        "steps": 4,
        "checkpoint": f"{slug}/step-00000004",
        "slug": slug,
        "updated": NOW + 10,
        "run": "lm",
        "file": "/runs/lm.sx",
        "pid": 4242,
        "host": "elsewhere",
        "started": NOW,
        **fields,
    }


def _point(step: object, name: str, value: object, time: object = NOW) -> dict:
    return {"kind": "point", "id": f"{name}-{step}", "step": step, "time": time,
            "name": name, "value": value}  # fmt: skip


def _run(root: Path, slug: str, status: dict | str | None, events: list | None = None) -> Path:
    folder = root / slug
    folder.mkdir(parents=True)
    if status is not None:
        text = status if isinstance(status, str) else json.dumps(status)
        (folder / "status.json").write_text(text)
    lines = events if events is not None else [_point(s, "loss", 1.0 / s) for s in (1, 2, 3, 4)]
    (folder / "events.jsonl").write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return folder


# A status field no run writes, each in a folder of its own (items 3-5 of issue 24).
FORGED_STATUS = {
    "pid-past-int32": {"pid": 2147483648, "state": "running", "host": "HOST"},
    "pid-negative": {"pid": -1, "state": "running", "host": "HOST"},
    "pid-bool": {"pid": True, "state": "running", "host": "HOST"},
    "updated-nan": {"updated": float("nan")},
    "started-infinite": {"started": float("inf")},
    "updated-1e300": {"updated": 1e300},
    "file-number": {"file": 123},
    "checkpoint-list": {"checkpoint": [1, 2]},
    "error-object": {"error": {}},
    "step-text": {"step": "abc"},
    "steps-400-digits": {"steps": 10**400},
    "state-list": {"state": ["running"]},
}


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """A metrics folder of two good runs and one folder per forged status field."""
    import socket

    root = tmp_path / "metrics"
    for slug, when in (("good-old", NOW - 100), ("good-new", NOW + 100)):
        points = [_point(s, "loss", 1.0 / s, when + s) for s in (1, 2, 3, 4)]
        _run(root, slug, _status(slug, started=when), points)
    for slug, fields in FORGED_STATUS.items():
        fields = {k: socket.gethostname() if v == "HOST" else v for k, v in fields.items()}
        # Python writes NaN, Infinity and 400-digit integers as a forger would
        _run(root, slug, _status(slug, **fields))
    _run(root, "not-json", "{")
    _run(root, "deep", "[" * 200_000 + "]" * 200_000)
    _run(root, "\x1b[31mred\x1b[0m", _status("\x1b[31mred\x1b[0m\nnext"))
    nan_loss = [_point(1, "loss", "NaN"), _point(1, "probe/acc", "Infinity")]
    _run(root, "nan-loss", _status("nan-loss"), nan_loss)
    return root


def test_runs_lists_every_folder_with_one_line_each_and_strict_json(hostile: Path) -> None:
    listed = run_sexpgpu("runs", "--json", "--metrics-dir", hostile, cwd=hostile.parent)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    rows = {row["folder"].rsplit("/", 1)[1]: row for row in json.loads(listed.stdout)}
    assert len(rows) == len(os.listdir(hostile))
    for slug in ("good-old", "good-new"):
        assert rows[slug]["state"] == "finished" and rows[slug]["loss"] == 0.25
    for slug, fields in FORGED_STATUS.items():
        field = next(iter(fields))
        assert rows[slug]["state"] == "unknown", slug
        assert rows[slug]["error"].startswith(f"unreadable status.json: '{field}' is"), slug
    for slug in ("not-json", "deep"):
        assert rows[slug]["state"] == "unknown"
    # strict JSON: a NaN loss or infinite eval number is null, never a bare NaN
    json.loads(listed.stdout, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert rows["nan-loss"]["loss"] is None and rows["nan-loss"]["evals"] == {"probe/acc": None}

    table = sexpgpu_in_process("runs", "--metrics-dir", hostile, cwd=hostile.parent)
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and "\\x1b[31mred\\x1b[0m\\nnext" in table.stdout
    assert len(table.stdout.splitlines()) == 1 + len(rows), "one line per run"
    order = [line.split()[0] for line in table.stdout.splitlines()[1:]]
    assert order[0] == "good-new" and order.index("good-old") < order.index("not-json")


def _report(folder: Path) -> subprocess.CompletedProcess[str]:
    return sexpgpu_in_process("report", folder, "--out", folder / "page", cwd=folder.parent)


FORGED_EVENTS = {
    "step-null": [_point(None, "loss", 1.0)],
    "step-text": [_point("abc", "loss", 1.0)],
    "step-list": [_point([1], "loss", 1.0)],
    "step-1e999": ['{"kind":"point","step":1e999,"time":1,"name":"loss","value":1}'],
    "step-400-digits": [_point(10**400, "loss", 1.0)],
    "step-bool": [_point(True, "loss", 1.0)],
    "time-text": [_point(1, "tokens", 5, "abc"), _point(2, "tokens", 9, "abc")],
    "time-1e300": [_point(1, "tokens", 5, 1e300), _point(2, "tokens", 9, 2e300)],
    "loss-huge": [_point(1, "loss", 1e308), _point(2, "loss", -1e308)],
    "annotation-step-text": [{"kind": "annotation", "step": "x", "text": "checkpoint a"}],
    "annotation-time-nan": [{"kind": "annotation", "step": 1, "time": "NaN", "text": 5}],
    "name-not-text": [_point(1, ["loss"], 1.0)],
    "nested": ["[" * 100_000 + "]" * 100_000, "{" + '"a":' * 50_000],
}


@pytest.mark.parametrize("case", sorted(FORGED_EVENTS))
def test_a_forged_event_costs_its_point_not_the_report(tmp_path: Path, case: str) -> None:
    good = [_point(s, "loss", 1.0 / s) for s in (1, 2, 3)]
    folder = _run(tmp_path, case, _status(case), [*FORGED_EVENTS[case], *good])
    written = _report(folder)
    assert written.returncode == 0, written.stderr
    assert (folder / "page" / "index.html").is_file() or any((folder / "page").glob("*.html"))


def test_math_markup_in_a_name_is_drawn_as_written(tmp_path: Path) -> None:
    """An eval pass named ``$x^$`` (the language accepts it) is no math for matplotlib;
    ``probe/a+b`` and ``probe/a*b`` stay two charts."""
    events = [_point(s, n, 0.5) for s in (1, 2) for n in ("$x^$/loss", "probe/a+b", "probe/a*b")]
    folder = _run(tmp_path, "markup", _status("markup"), events)
    written = _report(folder)
    assert written.returncode == 0, written.stderr
    charts = sorted(p.name for p in (folder / "page").glob("eval-*.png"))
    assert len(charts) == 3, charts
    page = next((folder / "page").glob("*.html")).read_text()
    assert page.count('id="eval-probe-a-b') >= 2 and len(set(charts)) == 3


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_events_that_are_no_file_are_one_line(tmp_path: Path, kind: str) -> None:
    folder = _run(tmp_path, kind, _status(kind))
    (folder / "events.jsonl").unlink()
    if kind == "fifo":
        os.mkfifo(folder / "events.jsonl")
    else:
        (folder / "events.jsonl").symlink_to("/dev/zero")
    # a subprocess with a time limit: a hang or a memory fill would not come back
    written = subprocess.run(
        [sys.executable, "-m", "sexpgpu_cli", "report", str(folder), "--out", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert written.returncode != 0 and "Traceback" not in written.stderr, written.stderr
    (line,) = [line for line in written.stderr.splitlines() if line.strip()]
    assert "E-REPORT-004" in line and "regular file" in line
    listed = sexpgpu_in_process("runs", "--json", "--metrics-dir", tmp_path, cwd=tmp_path)
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["state"] == "finished"


def test_a_long_run_and_a_long_annotation_make_a_page_of_bounded_size(tmp_path: Path) -> None:
    """100,000 steps are drawn from each stretch's extremes, every mark kept; a
    500 KB annotation is shown cut, whole in events.jsonl."""
    steps = 100_000

    def value(s: int) -> float:
        return 1.0 + (s % 997) / 997 if s != 77_777 else 50.0  # a saw, one spike

    lines = [
        f'{{"kind":"point","step":{s},"time":{NOW + s},"name":"loss","value":{value(s)!r}}}'
        for s in range(1, steps + 1)
    ]
    marks = [{"kind": "annotation", "step": s, "time": NOW + s, "text": f"checkpoint step-{s}"}
             for s in range(10_000, steps + 1, 10_000)]  # fmt: skip
    long = {"kind": "annotation", "step": 5, "time": NOW + 5, "text": "failed: " + "x" * 500_000}
    folder = _run(tmp_path, "long", _status("long", step=steps, steps=steps),
                  [*lines, *marks, long])  # fmt: skip
    written = _report(folder)
    assert written.returncode == 0, written.stderr
    page = next((folder / "page").glob("*.html"))
    assert page.stat().st_size < 1_000_000, page.stat().st_size
    text = page.read_text()
    assert all(f"checkpoint step-{s}" in text for s in range(10_000, steps + 1, 10_000))
    assert "(498008 more characters)" in text and "x" * 500_000 not in text
    from sexpgpu_report.plots import thinned

    curve = [(s, value(s)) for s in range(1, steps + 1)]
    drawn = thinned(curve)
    assert (77_777, 50.0) in drawn, "a spike is kept"
    assert max(v for _, v in drawn) == 50.0 and min(v for _, v in drawn) == 1.0
    assert list(drawn) == sorted(drawn) and len(drawn) <= 4000
