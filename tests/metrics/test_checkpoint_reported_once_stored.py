"""A checkpoint is reported (the ``checkpoint <location>`` annotation, the status file's
``checkpoint``, the log line) only once its ``experiment.json`` is stored, and never
when its write failed; a run in this process, on a storage backend the test hands in
that holds a write back on an Event or fails it.

Each report is recorded as it is made, on the thread that makes it, with whether the
checkpoint's ``experiment.json`` existed at that moment: the annotation as the metrics
stream is handed it (its sinks write later, on threads of their own), the status
file's field as it is set, the log line as it is logged."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog

import sexpgpu.log
import sexpgpu_data
import sexpgpu_eval
import sexpgpu_jsonl
import sexpgpu_local
import sexpgpu_torch
from sexpgpu.catalog import Catalog
from sexpgpu.checkpoint.storage import WRITE_FAILED
from sexpgpu.errors import StorageError
from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.metrics import MetricsStream
from sexpgpu.session import Selection
from sexpgpu.status import StatusFile
from sexpgpu.train import RunOptions, run
from sexpgpu_local.backend import LocalStorage
from tests.catalogs import tiny_program

PROGRAM = tiny_program("reported", checkpoint_every=2)
FIRST = "step-00000002"
MARKER = "experiment.json"
HANG = 60.0  # seconds: only a bound on a hang, never reached by a run that works


@dataclass(frozen=True)
class Report:
    channel: str  # annotation, status, log
    location: str
    stored: bool  # whether the checkpoint's experiment.json existed as it was reported


class Held(LocalStorage):
    """A local folder whose writes of :data:`FIRST` are held back until ``release`` is
    set; with ``fail`` (a file name), that file's write fails instead, as a storage
    backend's write fails, and the others go through."""

    def __init__(self, path: str, release: threading.Event, fail: str | None) -> None:
        super().__init__(path)
        self.release, self.fail = release, fail

    def _hold(self, keys) -> None:
        mine = [key for key in keys if key.startswith(FIRST + "/")]
        if not mine:
            return
        if self.fail is not None:
            if f"{FIRST}/{self.fail}" in mine:
                raise StorageError(
                    f"cannot write {self.uri}/{FIRST}: disk on fire", code=WRITE_FAILED
                )
        elif not self.release.wait(HANG):
            raise AssertionError(f"{FIRST} was never released: the loop did not go on")

    def write_many(self, items) -> None:
        self._hold(items)
        super().write_many(items)

    def write(self, key, data) -> None:
        self._hold([key])
        super().write(key, data)


class HeldPlugin:
    """Supplies ``held://PATH``: a :class:`Held` folder at PATH."""

    def __init__(self, release: threading.Event, fail: str | None) -> None:
        self.release, self.fail = release, fail

    @hookimpl
    def sexpgpu_storage_backends(self) -> list[StorageBackendInfo]:
        def open_held(uri: str) -> Held:
            return Held(uri.removeprefix("held://"), self.release, self.fail)

        return [StorageBackendInfo(schemes=("held",), factory=open_held, doc="held writes")]


def catalog(release: threading.Event, fail: str | None = None) -> Catalog:
    return Catalog.of(
        {
            "torch": sexpgpu_torch,
            "data": sexpgpu_data,
            "eval": sexpgpu_eval,
            "jsonl": sexpgpu_jsonl,
            "local": sexpgpu_local,
            "held": HeldPlugin(release, fail),
        }
    )


def stored(location: str) -> bool:
    return (Path(location) / MARKER).is_file()


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch) -> list[Report]:
    """Every checkpoint report the run makes, as it makes it."""
    made: list[Report] = []
    annotation, update = MetricsStream.annotation, StatusFile.update

    def annotate(stream, step, text, /, **fields):
        if text.startswith("checkpoint "):
            location = text.removeprefix("checkpoint ")
            made.append(Report("annotation", location, stored(location)))
        return annotation(stream, step, text, **fields)

    def set_fields(status, **fields):
        if fields.get("checkpoint") is not None:
            made.append(Report("status", fields["checkpoint"], stored(fields["checkpoint"])))
        return update(status, **fields)

    def log(logger, method, event):
        if event.get("event") == "checkpoint":
            made.append(Report("log", event["location"], stored(event["location"])))
        return event

    monkeypatch.setattr(MetricsStream, "annotation", annotate)
    monkeypatch.setattr(StatusFile, "update", set_fields)
    # the product's loggers resolve structlog's configuration as they log
    saved = structlog.get_config()
    monkeypatch.setattr(sexpgpu.log, "_configured", True)
    structlog.configure(
        processors=[log, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=io.StringIO()),
        cache_logger_on_first_use=False,
    )
    yield made
    structlog.configure(**saved)


def train(tmp_path: Path, catalog: Catalog, monkeypatch: pytest.MonkeyPatch, on_step=None):
    """Run the program into ``tmp_path/ck`` (a held:// location); ``on_step(step)`` is
    called as the loop reports each step's loss, on the loop's thread."""
    if on_step is not None:
        point = MetricsStream.point

        def reporting(stream, step, name, value, /, **fields):
            if name == "loss":
                on_step(step)
            return point(stream, step, name, value, **fields)

        monkeypatch.setattr(MetricsStream, "point", reporting)
    (tmp_path / "reported.sx").write_text(PROGRAM)
    options = RunOptions(
        Selection(str(tmp_path / "reported.sx")),
        metrics_dir=str(tmp_path / "m"),
        metrics_sinks=("jsonl",),
        checkpoint_dir=f"held://{tmp_path / 'ck'}",
    )
    return run(options, catalog)


def test_a_checkpoint_held_back_is_reported_only_once_stored(reports, tmp_path, monkeypatch):
    release = threading.Event()
    seen_while_held: list[Report] = []

    def on_step(step: int) -> None:
        # the loop has gone on past the checkpoint of step 2, whose write is held:
        # what was reported until now, then let the write go
        if step == 3:
            seen_while_held.extend(reports)
            release.set()

    outcome = train(tmp_path, catalog(release), monkeypatch, on_step)
    assert outcome.exit_code == 0, outcome.message
    assert release.is_set()
    assert seen_while_held == []
    first, last = (str(tmp_path / "ck" / f"step-{n:08d}") for n in (2, 4))
    early = [r for r in reports if not r.stored]
    assert early == [], "reported before its experiment.json was stored"
    # each checkpoint on each channel (the status file names the last one again as
    # the run closes)
    assert [(r.channel, r.location) for r in reports] == [
        ("annotation", first),
        ("status", first),
        ("log", first),
        ("annotation", last),
        ("status", last),
        ("log", last),
        ("status", last),
    ]


@pytest.mark.parametrize("failing", ["params.safetensors", MARKER])
def test_a_checkpoint_whose_write_failed_is_never_reported(failing, reports, tmp_path, monkeypatch):
    outcome = train(tmp_path, catalog(threading.Event(), fail=failing), monkeypatch)
    assert outcome.exit_code == 1
    assert "disk on fire" in outcome.message
    first = tmp_path / "ck" / FIRST
    assert not (first / MARKER).exists()
    assert [r for r in reports if r.location == str(first)] == []
