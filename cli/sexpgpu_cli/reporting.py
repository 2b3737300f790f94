"""What a run tells the person watching it: step lines, eval numbers, a progress bar, a summary.

The :class:`sexpgpu.outputs.Reporter` of ``sexpgpu run``.

Off a terminal the run logs a ``step`` line (step, loss, learning rate,
throughput) at a bounded rate set by ``--log-every`` (:class:`LogEvery`), each
eval pass's numbers as they land, and a closing summary, all through the
structured logger, so ``--log-format json`` carries the same fields. On a
terminal a rich progress bar takes the place of the step lines; it stays on
screen at the end, and log lines print above it.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import UsageError
from sexpgpu.log import get_logger
from sexpgpu_cli import logstream

__all__ = ["DEFAULT_LOG_EVERY", "LogEvery", "Reporter"]

DEFAULT_LOG_EVERY = "30s"
"""A step line every 30 seconds: a few hundred lines over a day-long run."""

_PART = re.compile(r"^\s*(\d+)\s*(s?)\s*$")


@dataclass(frozen=True)
class LogEvery:
    """How often a step line is logged: every ``steps`` steps and/or ``seconds`` seconds,
    whichever comes first (``None``: not by that measure)."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> LogEvery:
        """``100`` (steps), ``30s`` (seconds) or both, ``100,30s``. Raises
        :class:`UsageError` for anything else."""
        steps = seconds = None
        for part in text.split(","):
            match = _PART.match(part)
            if not match or int(match.group(1)) < 1:
                raise UsageError(
                    f"--log-every takes steps (100), seconds (30s) or both (100,30s), got {text!r}"
                )
            if match.group(2):
                seconds = float(match.group(1))
            else:
                steps = int(match.group(1))
        return cls(steps, seconds)

    def due(self, steps_since: int, seconds_since: float) -> bool:
        """Whether a line is due ``steps_since`` steps and ``seconds_since`` seconds
        after the last one."""
        return (self.steps is not None and steps_since >= self.steps) or (
            self.seconds is not None and seconds_since >= self.seconds
        )


class Reporter:
    """The step lines, eval numbers, progress bar and summary of one run (a
    :class:`sexpgpu.outputs.Reporter`)."""

    def __init__(
        self, *, total: int, step: int, every: LogEvery, terminal: bool, tokens: int | None
    ) -> None:
        self.log = get_logger("sexpgpu.run")
        self.total = total
        self.every = every
        self.started = time.monotonic()
        self.first_step = step
        self.first_tokens = tokens or 0
        self.loss: float | None = None
        self.tokens = tokens
        self.evals: dict[str, dict[str, float]] = {}
        self._mark = (step, self.started, tokens or 0)  # the last step line: step, time, tokens
        self._logged_any = False
        self._bar: Any = None
        if terminal and sys.stderr.isatty():
            self._bar = _Bar(total, step)

    def step(self, step: int, loss: float, lr: float, tokens: int | None) -> None:
        """A committed step: draw it, or log it when a line is due."""
        self.loss, self.tokens = loss, tokens
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(step, loss, self._rate(tokens, now))
            return
        last_step, last_time, last_tokens = self._mark
        if self._logged_any and not self.every.due(step - last_step, now - last_time):
            return
        seconds = max(now - last_time, 1e-9)
        fields: dict[str, Any] = {
            "step": step,
            "steps": self.total,
            "loss": round(loss, 6),
            "lr": lr,
            "steps_per_s": round((step - last_step) / seconds, 3),
        }
        if tokens is not None:
            fields["tokens_per_s"] = round((tokens - last_tokens) / seconds, 1)
        self.log.info("step", **fields)
        self._mark = (step, now, tokens or 0)
        self._logged_any = True

    def evaluated(self, step: int, name: str, numbers: dict[str, float]) -> None:
        """An eval pass's numbers, logged as they land."""
        rounded = {key: round(value, 6) for key, value in numbers.items()}
        self.evals[name] = rounded
        self.log.info("eval", step=step, eval_pass=name, **rounded)

    def _rate(self, tokens: int | None, now: float) -> float | None:
        if tokens is None:
            return None
        return (tokens - self.first_tokens) / max(now - self.started, 1e-9)

    def close(self) -> None:
        """Stop drawing; the last progress state stays on screen."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def summary(self, state: str, step: int, **fields: Any) -> None:
        """The closing summary (``run finished``, ``run interrupted``, ``run failed``):
        steps, final loss, the last eval numbers, wall time, tokens/s and ``fields``
        (last checkpoint, where the metrics are)."""
        self.close()
        seconds = time.monotonic() - self.started
        summary: dict[str, Any] = {"step": step, "steps": self.total}
        summary["steps_run"] = step - self.first_step
        if self.loss is not None:
            summary["loss"] = round(self.loss, 6)
        if self.evals:
            summary["eval"] = self.evals
        summary["seconds"] = round(seconds, 3)
        if self.tokens is not None:
            summary["tokens_per_s"] = round(
                (self.tokens - self.first_tokens) / max(seconds, 1e-9), 1
            )
        summary.update(fields)
        self.log.info(f"run {state}", **summary)


class _Bar:
    """The terminal progress bar (rich): step/total, loss, tokens/s, ETA."""

    def __init__(self, total: int, step: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            redirect_stderr=False,
            redirect_stdout=False,
            transient=False,
            refresh_per_second=4,
        )
        self.task = self.progress.add_task("train", total=total, completed=step, loss="-", rate="")
        self.progress.start()
        # Log lines print above the bar, whole (no wrapping, no markup), colours kept.
        console = self.progress.console
        logstream.redirect(lambda line: console.print(Text.from_ansi(line), soft_wrap=True))

    def update(self, step: int, loss: float, rate: float | None) -> None:
        text = f"{rate:,.0f} tok/s" if rate is not None else ""
        self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", rate=text)

    def close(self) -> None:
        # stop() draws the last state once more and leaves it on screen.
        self.progress.stop()
        logstream.redirect(None)
