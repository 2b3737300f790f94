"""The embedded JSONL sink, through the plugin machinery and the stream, as a run uses it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sexpgpu.metrics import MetricsStream, open_sinks
from sexpgpu_jsonl.sink import JsonlSink, events_path, read_events
from tests.catalogs import project

PATIENCE = 30.0


def _strict_loads(line: str) -> dict:
    def refuse(token: str):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def _run(metrics_dir, slug, steps, *, done=True):
    stream = MetricsStream(
        open_sinks(["jsonl"], str(metrics_dir), slug, project()), experiment=slug
    )
    for step in steps:
        stream.point(step, "loss", 1.0 / step)
    if done:
        stream.done(steps[-1])
    assert stream.close(timeout=None) == 0


def test_the_plugin_supplies_the_jsonl_sink():
    record = project().record("jsonl")
    assert record is not None and record.available
    assert "sexpgpu_metrics_sinks" in record.hooks
    names = [info.name for info in project().available("sexpgpu_metrics_sinks")]
    assert "jsonl" in names


def test_one_strict_json_object_per_line(tmp_path):
    slug = "my-run-3f9a1c"
    stream = MetricsStream(open_sinks(["jsonl"], str(tmp_path), slug, project()), experiment=slug)
    stream.point(1, "loss", float("nan"))
    stream.point(1, "grad", float("inf"))
    stream.annotation(2, "checkpoint ünïcode", seconds=0.25, where=tmp_path, bad=float("-inf"))
    stream.done(2)
    assert stream.close(timeout=None) == 0

    lines = events_path(tmp_path, slug).read_text(encoding="utf-8").splitlines()
    events = [_strict_loads(line) for line in lines]
    assert [e["kind"] for e in events] == ["point", "point", "annotation", "done"]
    assert events[0]["value"] == "NaN" and events[1]["value"] == "Infinity"
    assert float(events[0]["value"]) != float(events[0]["value"])  # float() reads it back
    assert events[2]["text"] == "checkpoint ünïcode"
    assert events[2]["where"] == str(tmp_path) and events[2]["bad"] == "-Infinity"
    assert events[2]["seconds"] == 0.25
    assert all(e["experiment"] == slug for e in events)


def test_a_resumed_run_appends_to_the_same_experiment(tmp_path):
    slug = "my-run-3f9a1c"
    _run(tmp_path, slug, [1, 2, 3, 4], done=False)  # interrupted: no done
    _run(tmp_path, slug, [5, 6])  # resumed
    events = list(read_events(events_path(tmp_path, slug)))
    assert [(e["kind"], e["step"]) for e in events] == [
        ("point", 1),
        ("point", 2),
        ("point", 3),
        ("point", 4),
        ("point", 5),
        ("point", 6),
        ("done", 6),
    ]
    assert len({e["id"] for e in events}) == len(events)


def test_a_torn_last_line_is_ended_before_appending(tmp_path):
    slug = "exp"
    _run(tmp_path, slug, [1, 2], done=False)
    path = events_path(tmp_path, slug)
    with open(path, "ab") as f:
        f.write(b'{"kind":"point","id":"abc","ste')  # killed in the middle of a write
    _run(tmp_path, slug, [3])
    lines = path.read_text().splitlines()
    assert lines[2] == '{"kind":"point","id":"abc","ste'
    assert _strict_loads(lines[3])["step"] == 3
    assert [e["step"] for e in read_events(path)] == [1, 2, 3, 3]


def test_a_failed_write_reopens_the_file_and_retries(tmp_path):
    sink = JsonlSink(tmp_path, "exp")
    sink.write([{"kind": "point", "step": 1}])
    os.close(sink._fd)  # the descriptor goes bad under the sink
    with pytest.raises(OSError):
        sink.write([{"kind": "point", "step": 2}])
    sink.write([{"kind": "point", "step": 2}])
    sink.close()
    assert [e["step"] for e in read_events(events_path(tmp_path, "exp"))] == [1, 2]


def test_events_reach_the_file_before_the_stream_is_closed(tmp_path):
    slug = "live"
    stream = MetricsStream(open_sinks(["jsonl"], str(tmp_path), slug, project()), experiment=slug)
    stream.point(1, "loss", 0.5)
    path = events_path(tmp_path, slug)
    give_up = time.monotonic() + PATIENCE
    while time.monotonic() < give_up and not path.read_bytes():
        time.sleep(0.01)
    assert [e["step"] for e in read_events(path)] == [1]  # what `tail -f` shows
    stream.close(timeout=None)


@pytest.mark.slow
def test_events_written_before_a_kill_are_in_the_file(tmp_path):
    child = textwrap.dedent(
        f"""
        import sys, time
        from sexpgpu.catalog import Catalog
        from sexpgpu.metrics import MetricsStream, open_sinks
        stream = MetricsStream(
            open_sinks(["jsonl"], {str(tmp_path)!r}, "killed", Catalog.load()), experiment="killed"
        )
        for step in range(1, 6):
            stream.point(step, "loss", 0.5)
        while stream.pending():
            time.sleep(0.01)
        print("delivered", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "delivered", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = list(read_events(events_path(tmp_path, "killed")))
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5]


def test_importing_the_sink_plugins_imports_nothing_heavy():
    code = (
        "import sys, sexpgpu_jsonl, sexpgpu_tensorboard, sexpgpu.metrics, sexpgpu.status\n"
        "sexpgpu_jsonl.sexpgpu_metrics_sinks(); sexpgpu_tensorboard.sexpgpu_metrics_sinks()\n"
        "sexpgpu_tensorboard.sexpgpu_unavailable()\n"
        "print(sorted(m for m in ('torch', 'tensorboard', 'boto3', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_removed_or_replaced_file_is_opened_again(tmp_path):
    # A clean-up that removes the file mid-run: without looking, every later event
    # would go into a file that no longer has a name.
    sink = JsonlSink(tmp_path, "exp")
    sink.write([{"kind": "point", "step": 1}])
    path = tmp_path / "exp" / "events.jsonl"
    path.unlink()
    sink.write([{"kind": "point", "step": 2}])
    assert [e["step"] for e in read_events(path)] == [2]
    path.rename(tmp_path / "exp" / "old.jsonl")
    path.write_text("")  # another file under the name
    sink.write([{"kind": "point", "step": 3}])
    sink.close()
    assert [e["step"] for e in read_events(path)] == [3]


def test_read_events_skips_an_over_long_line_in_pieces(tmp_path: Path) -> None:
    from sexpgpu_jsonl.sink import MOST_LINE

    path = tmp_path / "events.jsonl"
    long_line = b'{"kind": "point", "step": 2, "text": "' + b"x" * (3 * MOST_LINE) + b'"}\n'
    path.write_bytes(
        b'{"kind": "point", "step": 1}\n' + long_line + b'{"kind": "point", "step": 3}\n'
    )
    assert [e["step"] for e in read_events(path)] == [1, 3]


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_read_events_refuses_what_is_no_regular_file_without_hanging(
    tmp_path: Path, special: str
) -> None:
    path = tmp_path / "events.jsonl"
    if special == "fifo":
        os.mkfifo(path)  # no writer: reading it would block for ever
    else:
        path.symlink_to("/dev/zero")  # reading it whole would fill the memory
    with pytest.raises(OSError, match="is not a regular file"):
        list(read_events(path))
