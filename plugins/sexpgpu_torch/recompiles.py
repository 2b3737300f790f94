"""Saying so when a compiled graph compiles again after its first call.

Each graph of the compiled lowering compiles on its first call (the run's warm-up,
or an eval pass's first batch under ``sexpgpu evaluate``). A program's shapes and
options are fixed, so a later compile is a defect: a step pays for it, and the new
code need not add in the old order. Every later call runs under dynamo's
``error_on_recompile`` (:func:`watching`: set around each call, or once around a
stretch of calls), so a failing guard raises instead of compiling quietly; the call
then says once which graph and which guard, and compiles as torch would.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sexpgpu.log import get_logger

RECOMPILED = "compiled again after its first call"
"""The log line's event: a graph's guard failed after warm-up."""


class CompiledOnce:
    """A ``torch.compile``'d callable whose compiles after its first call are said in
    the log, once each (see the module docstring)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.called = False
        self.said = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled callable's result."""
        if not self.called:  # the first compile is no recompile, nor its inner frames'
            with _unwatched() if _watch.on else contextlib.nullcontext():
                result = self.compiled(*args, **kwargs)
            self.called = True
            return result
        if _watch.on:
            try:
                return self.compiled(*args, **kwargs)
            except _dynamo()[1] as exc:
                self._say(str(exc))
            with _unwatched():
                return self.compiled(*args, **kwargs)
        with watching():
            return self(*args, **kwargs)

    def _say(self, message: str) -> None:
        if self.said:
            return
        self.said = True
        # "Recompiling function NAME in FILE:LINE", then the guards that failed
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        graph = lines[0].removeprefix("Recompiling function ") if lines else "?"
        guards = [line.removeprefix("- ") for line in lines if line.startswith("- ")]
        get_logger("sexpgpu.run").warning(
            RECOMPILED, graph=graph, guard=guards[0] if guards else message[:300]
        )


class _Watch:
    on = False
    """dynamo's ``error_on_recompile`` is set (by :func:`watching`)."""


_watch = _Watch()


@contextmanager
def watching() -> Iterator[None]:
    """dynamo's ``error_on_recompile`` set for the calls inside (as ours), put back
    after: a generation's trips, a few hundred microseconds each, are watched at no
    cost per call (setting it costs some microseconds each time)."""
    if _watch.on:
        yield
        return
    config = _dynamo()[0]
    previous = config.error_on_recompile
    config.error_on_recompile, _watch.on = True, True
    try:
        yield
    finally:
        config.error_on_recompile, _watch.on = previous, False


@contextmanager
def _unwatched() -> Iterator[None]:
    """Compile again as torch would (after saying so), then watch on."""
    config = _dynamo()[0]
    config.error_on_recompile, _watch.on = False, False
    try:
        yield
    finally:
        config.error_on_recompile, _watch.on = True, True


@functools.cache
def _dynamo() -> tuple[Any, type[Exception]]:
    # imported once a graph has compiled: dynamo's import is heavy for an eager run
    import torch._dynamo.config as config
    from torch._dynamo.exc import RecompileError

    return config, RecompileError
