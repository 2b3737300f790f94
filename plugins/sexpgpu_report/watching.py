"""``sexpgpu report --watch``: the report written again as the run goes.

Bounded: it ends by itself once the run has ended (its status is no longer
``running``, or its process is gone) after one last write, and a signal stops
it between two writes, never inside one, so the page on disk is always whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sexpgpu.signals import StopWatch, process_watch
from sexpgpu_report.listing import RunRow

__all__ = ["watch_report"]


def _ended(row: RunRow | None) -> bool:
    return row is not None and (row.state != "running" or row.process == "gone")


def _wait(seconds: float, watch: StopWatch) -> None:
    deadline = time.monotonic() + seconds
    while not watch.stopping and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.1, left))


def watch_report(
    folder: Path, target: Path, interval: float, write_once: Callable[[Path, Path, float], Any]
) -> int:
    """Write the report of ``folder`` into ``target`` with ``write_once`` every
    ``interval`` seconds until the run ends (returns 0) or a signal comes (returns
    ``128 + n``)."""
    watch = process_watch()
    owned = watch is None
    if watch is None:  # called from Python, not the console script
        watch = StopWatch()
        watch.install()
    try:
        watch.loop_started()  # from here a signal stops the loop between two writes
        while True:
            written = write_once(folder, target, interval)
            if _ended(written.row):
                # once more without the page's reload: it will not change again
                write_once(folder, target, 0.0)
                return 0
            _wait(interval, watch)
            if watch.stopping:
                name, signum = watch.settle()
                click.echo(
                    f"sexpgpu report: interrupted by {name}; {written.page} is complete",
                    err=True,
                )
                return 128 + signum
    finally:
        watch.ended()
        if owned:
            watch.uninstall()
