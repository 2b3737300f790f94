"""Errors a user can cause: one line, a stable code where there is one, never a traceback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pos:
    """A place in a `.sx` source: the file as the user named it, 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class SexpError(Exception):
    """An error the user can fix. ``str()`` is the one line printed to them.

    ``code`` is a stable identifier (``E-LOAD-001``) listed in docs/errors.md, or
    ``None`` for errors whose message says everything. ``exit_code`` is what the
    CLI exits with (1 for errors in a run or its inputs, 2 for usage errors).
    """

    exit_code = 1
    step: int | None = None
    """The run's step it belongs to, where that is not the step in progress (a
    checkpoint written in the background names its own step)."""

    def __init__(self, message: str, *, code: str | None = None, pos: Pos | None = None):
        self.message = message
        self.code = code
        self.pos = pos
        super().__init__(self.render())

    def render(self) -> str:
        text = self.message
        if self.code and not text.startswith(self.code):
            text = f"{self.code}: {text}"
        return text if self.pos is None else f"{self.pos}: {text}"


class UsageError(SexpError):
    """A command line that cannot be taken as written (bad flag value, unknown knob)."""

    exit_code = 2


class SourceError(SexpError):
    """An error in a `.sx` file, positioned at file:line:col."""


class PluginError(SexpError):
    """A plugin, or something asked of one, that is missing or unavailable."""


class StorageError(SexpError):
    """A checkpoint location that cannot be read, listed or written."""


class CheckpointError(SexpError):
    """A checkpoint that is damaged, foreign, or cannot be resumed by this run."""


class RunError(SexpError):
    """A run that failed while training (data errors, non-finite values, a failing op)."""
