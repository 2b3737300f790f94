"""The metrics stream: event format, order, delivery off the step loop, draining."""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
import structlog

from sexpgpu.errors import PluginError, RunError
from sexpgpu.log import get_logger
from sexpgpu.metrics import RESERVED_KEYS, MetricsStream, new_slug, open_sinks
from tests.catalogs import project

# Generous bound for "the background thread got there": a bound on a hang, not a timing claim.
PATIENCE = 30.0


class RecordingSink:
    """Keeps every batch it is given; can be told to block or fail."""

    def __init__(self, *, fail_times: int = 0, always_fail: bool = False, gate=None):
        self.batches: list[list[dict]] = []
        self.fail_times = fail_times
        self.always_fail = always_fail
        self.gate = gate  # a threading.Event write() waits on before storing
        self.entered = threading.Event()  # write() has been called at least once
        self.attempts = 0
        self.closed = 0
        self.closed_after_writes: int | None = None
        self.got = threading.Condition()

    @property
    def events(self) -> list[dict]:
        return [e for batch in self.batches for e in batch]

    def write(self, events):
        self.attempts += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if self.always_fail or self.fail_times > 0:
            self.fail_times -= 1
            raise ConnectionError("collector is down")
        with self.got:
            self.batches.append(list(events))
            self.got.notify_all()

    def wait_for(self, count: int) -> bool:
        with self.got:
            return self.got.wait_for(lambda: len(self.events) >= count, timeout=PATIENCE)

    def close(self):
        self.closed += 1
        self.closed_after_writes = len(self.batches)


def test_events_have_the_documented_fields_and_unique_ids():
    sink = RecordingSink()
    stream = MetricsStream([sink], experiment="my-run-3f9a1c")
    before = time.time()
    stream.point(1, "loss", 0.25)
    stream.point(1, "tokens", 512)
    stream.annotation(2, "checkpoint /tmp/x/step-00000002", seconds=0.5, bytes=1024)
    stream.done(2)
    assert stream.close(timeout=None) == 0
    after = time.time()

    point, tokens, note, done = sink.events
    assert point == {
        "kind": "point",
        "id": point["id"],
        "experiment": "my-run-3f9a1c",
        "step": 1,
        "time": point["time"],
        "name": "loss",
        "value": 0.25,
    }
    assert tokens["value"] == 512 and type(tokens["value"]) is int
    assert note["kind"] == "annotation"
    assert note["text"] == "checkpoint /tmp/x/step-00000002"
    assert note["seconds"] == 0.5 and note["bytes"] == 1024 and note["step"] == 2
    assert set(done) == {"kind", "id", "experiment", "step", "time"}
    assert done["kind"] == "done" and done["step"] == 2
    ids = [e["id"] for e in sink.events]
    assert len(set(ids)) == 4
    for event in sink.events:
        assert uuid.UUID(hex=event["id"]).version == 4 and len(event["id"]) == 32
        assert before <= event["time"] <= after


def test_numpy_like_values_become_plain_numbers():
    class Scalar:
        def __float__(self):
            return 1.5

    sink = RecordingSink()
    stream = MetricsStream([sink], experiment="e")
    stream.point(3, "loss", Scalar())
    stream.point(3, "flag", True)
    stream.close(timeout=None)
    assert [e["value"] for e in sink.events] == [1.5, 1]
    assert type(sink.events[0]["value"]) is float


def test_annotation_fields_may_not_overwrite_the_stream_keys():
    stream = MetricsStream([RecordingSink()], experiment="e")
    for key in sorted(RESERVED_KEYS):
        with pytest.raises(ValueError, match=key):
            stream.annotation(1, "x", **{key: 1})
    assert stream.close(timeout=None) == 0


def test_order_is_kept_across_batches_and_sinks():
    first, second = RecordingSink(), RecordingSink()
    stream = MetricsStream([first, second], experiment="e", max_batch=7, linger=0.0)
    for step in range(500):
        stream.point(step, "loss", step / 10)
    assert stream.close(timeout=None) == 0
    for sink in (first, second):
        assert [e["step"] for e in sink.events] == list(range(500))
        assert all(len(batch) <= 7 for batch in sink.batches)
    # Both sinks get the same events, ids and all.
    assert [e["id"] for e in first.events] == [e["id"] for e in second.events]


def test_a_blocked_sink_never_blocks_the_producer():
    gate = threading.Event()
    sink = RecordingSink(gate=gate)
    stream = MetricsStream([sink], experiment="e", linger=0.0)
    stream.point(0, "loss", 1.0)
    assert sink.entered.wait(PATIENCE)  # the sink's thread is now stuck in write()
    # Every call returns while the sink's first write has not finished.
    for step in range(1, 2001):
        stream.point(step, "loss", 1.0)
        stream.annotation(step, "note")
    stream.done(2000)
    assert not gate.is_set() and sink.batches == []
    assert stream.pending() == 1 + 2 * 2000 + 1
    gate.set()
    assert stream.close(timeout=None) == 0
    assert len(sink.events) == 4002 and sink.events[-1]["kind"] == "done"


def test_a_failing_write_is_retried_in_order_and_logged():
    get_logger()  # configure structlog before capturing, so capture_logs stays in force
    sink = RecordingSink(fail_times=3)
    stream = MetricsStream([sink], experiment="e", linger=0.0, backoff=(0.001, 0.01))
    with structlog.testing.capture_logs() as logs:
        for step in range(50):
            stream.point(step, "loss", 0.5)  # returns although the sink raises
        assert sink.wait_for(50)
        assert stream.close(timeout=None) == 0
    assert [e["step"] for e in sink.events] == list(range(50))
    assert sink.attempts >= 4
    warnings = [entry for entry in logs if entry["event"].startswith("metrics sink write failed")]
    assert warnings and warnings[0]["log_level"] == "warning"
    assert "ConnectionError: collector is down" in warnings[0]["error"]


def test_a_sink_that_stays_down_neither_delays_the_others_nor_the_end():
    down, up = RecordingSink(always_fail=True), RecordingSink()
    stream = MetricsStream([down, up], experiment="e", linger=0.0, backoff=(0.001, 0.01))
    for step in range(20):
        stream.point(step, "loss", 0.5)
    stream.done(20)
    # The healthy sink gets everything while the other one keeps failing.
    assert up.wait_for(21)
    # The healthy sink's thread counts its batch delivered just after write() returns;
    # wait for that bookkeeping so the close below is not racing it.
    deadline = time.monotonic() + PATIENCE
    while stream.pending() != 21 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stream.pending() == 21
    # The failing sink's thread runs on its own schedule; on a loaded machine it may not have
    # tried yet when the healthy one is done.
    assert down.entered.wait(PATIENCE)
    assert down.events == [] and down.attempts >= 1
    missing = stream.close(timeout=0.2)
    assert missing == 21
    assert stream.undelivered_by_sink == {"0:RecordingSink": 21, "1:RecordingSink": 0}
    assert up.closed == 1 and down.closed == 1


def test_close_with_a_timeout_reports_what_a_stuck_sink_did_not_get():
    gate = threading.Event()
    sink = RecordingSink(gate=gate)
    stream = MetricsStream([sink], experiment="e", linger=0.0)
    for step in range(10):
        stream.point(step, "loss", 0.5)
    assert sink.entered.wait(PATIENCE)
    assert stream.close(timeout=0.1) == 10
    # A sink still inside write() is not closed under it.
    assert sink.closed == 0
    gate.set()


def test_close_drains_everything_then_closes_each_sink_once():
    sink = RecordingSink()
    # A long linger: without draining, nothing would be written before close returns.
    stream = MetricsStream([sink], experiment="e", linger=60.0)
    for step in range(100):
        stream.point(step, "loss", 0.5)
    stream.done(100)
    assert stream.close(timeout=None) == 0
    assert len(sink.events) == 101
    assert sink.closed == 1 and sink.closed_after_writes == len(sink.batches)
    assert stream.pending() == 0
    # Closing again is harmless, and a late event is dropped, not raised.
    assert stream.close(timeout=None) == 0
    stream.point(101, "loss", 0.5)
    assert len(sink.events) == 101 and sink.closed == 1


def test_events_are_delivered_while_the_run_goes_on():
    sink = RecordingSink()
    stream = MetricsStream([sink], experiment="e")
    stream.point(1, "loss", 0.5)
    # Delivered without close(): a live run is visible as it goes.
    assert sink.wait_for(1)
    stream.close(timeout=None)


def test_new_slug_is_the_stem_and_a_short_unique_suffix():
    slugs = {new_slug("my-run") for _ in range(200)}
    assert len(slugs) == 200
    for slug in slugs:
        assert re.fullmatch(r"my-run-[0-9a-f]{6}", slug)
    assert re.fullmatch(r"my-run-v2-[0-9a-f]{6}", new_slug("my run/v2"))
    assert re.fullmatch(r"run-[0-9a-f]{6}", new_slug("///"))


def test_open_sinks_resolves_names_through_the_plugins(tmp_path):
    sinks = open_sinks(["jsonl", "jsonl"], str(tmp_path), "exp-000001", project())
    assert [type(s).__name__ for s in sinks] == ["JsonlSink"]
    for sink in sinks:
        sink.close()
    assert (tmp_path / "exp-000001" / "events.jsonl").exists()


def test_open_sinks_names_an_unknown_sink(tmp_path):
    with pytest.raises(PluginError) as refused:
        open_sinks(["jsonl", "nope", "cvs"], str(tmp_path), "exp", project())
    assert refused.value.message.startswith("unknown metrics sink 'nope'; metrics sinks: jsonl")
    # a near name is offered, as for every other name
    with pytest.raises(PluginError) as near:
        open_sinks(["jsonk"], str(tmp_path), "exp", project())
    assert near.value.message.startswith("unknown metrics sink 'jsonk' (did you mean 'jsonl'?)")


def test_open_sinks_says_why_a_folder_cannot_be_used(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(RunError) as info:
        open_sinks(["jsonl"], str(blocker), "exp", project())
    message = str(info.value)
    assert message.startswith("the metrics sink 'jsonl' cannot be opened: ")
    assert "\n" not in message
