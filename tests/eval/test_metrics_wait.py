"""``--metrics-wait`` of ``sexpgpu run`` and ``sexpgpu evaluate``: how long the end waits
for the metrics sinks."""

from __future__ import annotations

import threading

import click
import pytest

from sexpgpu.metrics import MetricsStream
from sexpgpu_cli.commands.run import run
from sexpgpu_eval.command import evaluate
from sexpgpu_eval.follow import Reporting

PATIENCE = 20.0
"""A bound on a hang, under the default wait of 30 s: not a timing claim."""


class StuckSink:
    """A sink whose write does not return until told to."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, events) -> None:  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait()

    def close(self) -> None:
        pass


def test_the_end_waits_as_long_as_asked_and_counts_what_was_not_taken():
    sink = StuckSink()
    reporting = Reporting(catalog=None, metrics_dir="m", sinks=(), settle_seconds=1.0,
                          wait_seconds=0.2)  # fmt: skip
    stream = reporting.streams["e"] = MetricsStream([sink], experiment="e", linger=0.0)
    stream.point(1, "loss", 1.0)
    assert sink.entered.wait(PATIENCE)  # the sink's thread is stuck in its first write
    stream.point(2, "loss", 1.0)
    undelivered: list[int] = []
    closing = threading.Thread(target=lambda: undelivered.append(reporting.close()))
    closing.start()
    closing.join(PATIENCE)
    sink.gate.set()  # the stuck write returns and the sink's thread ends
    assert not closing.is_alive(), "close() waited longer than it was told to"
    assert undelivered == [2]


@pytest.mark.parametrize(
    ("command", "argument"), [(evaluate, "ck"), (run, "my-run.sx")], ids=["evaluate", "run"]
)
def test_the_wait_is_asked_on_the_command_line_or_in_the_environment(
    command, argument, monkeypatch
):
    monkeypatch.delenv("SEXPGPU_METRICS_WAIT", raising=False)

    def asked(*more: str) -> float:
        return command.make_context(command.name, [argument, *more]).params["metrics_wait"]

    assert asked() == 30.0
    assert asked("--metrics-wait", "0.5") == 0.5
    monkeypatch.setenv("SEXPGPU_METRICS_WAIT", "2")
    assert asked() == 2.0
    assert asked("--metrics-wait", "0") == 0.0  # the command line wins
    with pytest.raises(click.BadParameter):
        asked("--metrics-wait", "-1")
