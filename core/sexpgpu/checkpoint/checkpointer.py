"""Checkpoints of a run: snapshot in the step loop, write in the background, report on store.

The run loop calls :meth:`Checkpointer.save` at a step boundary. That waits for
the write before it (one write at a time, so the host arrays of the last
snapshot can be reused), snapshots the trainer's tensors to the host (the only
part the loop waits for) and hands the write to one background thread. The
moment the last byte is stored, that thread reports the checkpoint: the
metrics annotation (with ``seconds`` from the first tensor leaving the device
to the last byte stored), the status file's ``checkpoint`` and a log line. A
run killed outright after that still names it. Then, with ``keep_last``, it
deletes the complete checkpoints older than the newest ``keep_last``, less those a
follower (``sexpgpu evaluate --follow``) still owes a pass, within a bound
(:mod:`sexpgpu.checkpoint.evaluated`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.evaluated import HOLD_DEFAULT, HOLD_VARIABLE, unevaluated
from sexpgpu.checkpoint.storage import int_setting
from sexpgpu.errors import CheckpointError, SexpError
from sexpgpu.log import get_logger

if TYPE_CHECKING:
    from sexpgpu.extension import Storage, Trainer
    from sexpgpu.metrics import MetricsStream
    from sexpgpu.status import StatusFile

__all__ = ["Checkpointer"]


class Checkpointer:
    """Writes a run's checkpoints to ``storage`` one at a time, off the step loop.

    ``last`` is the location of the newest checkpoint stored by this run (or
    the one it resumed from, ``resumed_from``); it is set by the writer thread
    when a write is stored. ``keep_last`` (``None``: keep every checkpoint)
    is the retention. ``metrics`` and ``status`` are called from the writer
    thread, so both must be safe to call from another thread.
    """

    def __init__(
        self,
        storage: Storage,
        trainer: Trainer,
        *,
        metrics: MetricsStream,
        status: StatusFile,
        keep_last: int | None = None,
        passes: Sequence[tuple[str, int]] = (),
        resumed_from: str | None = None,
        written_step: int | None = None,
    ) -> None:
        self.storage = storage
        self.trainer = trainer
        self.metrics = metrics
        self.status = status
        self.keep_last = keep_last
        self.passes = tuple(passes)
        """The run's eval passes, ``(name, every)``: retention keeps what a follower owes."""
        self.hold = int_setting(HOLD_VARIABLE, HOLD_DEFAULT, 0) if keep_last is not None else 0
        self.last = resumed_from
        self.log = get_logger("sexpgpu.checkpoint")
        self._written_step = written_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sexpgpu-checkpoint")
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None

    def save(
        self,
        step: int,
        *,
        state: Callable[[], dict[str, Any]],
        experiment: Callable[[], dict[str, Any]],
        wait: bool = False,
    ) -> None:
        """Checkpoint ``step``: snapshot now, write and report in the background.

        ``state`` and ``experiment`` build the two JSON records. A step already
        written is not written again. With ``wait`` the call returns once the
        write is stored and reported. Raises :class:`CheckpointError` (or the
        storage's :class:`SexpError`) for a write that failed, this one's or
        the one before it.
        """
        from sexpgpu import checkpoint as ckpt

        if self._written_step == step:
            if wait:
                self.wait()
            return
        self.wait()
        started = time.perf_counter()
        # The previous write has finished: its host arrays can be reused.
        params, states = self.trainer.export(reuse=True)
        blocked = time.perf_counter() - started
        records = (state(), experiment())
        self._written_step = self._pending_step = step

        def write() -> None:
            key = ckpt.write_checkpoint(self.storage, step, params, states, *records)
            self._stored(step, key, time.perf_counter() - started, blocked)

        self._pending = self._pool.submit(write)
        if wait:
            self.wait()

    def _stored(self, step: int, key: str, seconds: float, blocked: float) -> None:
        """Report a stored checkpoint (writer thread), then apply retention."""
        from sexpgpu.checkpoint import location_of

        location = location_of(self.storage, key)
        self.last = location  # one assignment: a reader sees the old or the new location
        # seconds: first tensor leaving the device to the last byte stored (the spec);
        # blocked: how long of that the step loop waited (the host copy).
        self.metrics.annotation(
            step, f"checkpoint {location}", seconds=round(seconds, 6), blocked=round(blocked, 6)
        )
        self.status.update(checkpoint=location)
        self.log.info("checkpoint", location=location, step=step, seconds=round(seconds, 3))
        if self.keep_last is not None:
            self._retain(key)

    def _retain(self, key: str) -> None:
        from sexpgpu.checkpoint import location_of
        from sexpgpu.checkpoint.retention import prune

        try:
            deleted = prune(
                self.storage,
                self.keep_last or 1,
                protect=[key],
                hold=lambda old: unevaluated(self.storage, old, self.passes, self.hold),
            )
        except Exception as error:  # a storage plugin's own failure included
            # The checkpoint is stored; an old one left behind costs space, not the run.
            reason = error.render() if isinstance(error, SexpError) else f"{error}"
            self.log.warning("old checkpoints not deleted", error=reason.splitlines()[0])
            return
        for old in deleted:
            self.log.info("checkpoint deleted", location=location_of(self.storage, old))

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error if it failed."""
        pending, step = self._pending, self._pending_step
        if pending is None:
            return
        self._pending = None
        try:
            pending.result()
        except SexpError as error:
            self._written_step = None
            error.step = step
            raise
        except Exception as error:
            self._written_step = None
            failed = CheckpointError(f"writing the checkpoint of step {step} failed: {error}")
            failed.step = step
            raise failed from error

    def close(self) -> None:
        """Wait for the write in flight (errors ignored: :meth:`wait` reports them) and
        stop the writer thread."""
        try:
            self.wait()
        except SexpError:
            pass
        self._pool.shutdown(wait=True)


class LentExports:
    """A rank other than the writer, for a trainer whose ``export`` is a collective
    (``Trainer.exports_together``): it exports at the same steps as the writer's
    :class:`Checkpointer` (a step written already is skipped by both) and drops
    what it gets; it writes and reports nothing."""

    last = None  # rank 0 says where its checkpoints are

    def __init__(self, trainer: Trainer, written_step: int | None) -> None:
        self.trainer = trainer
        self._written_step = written_step

    def save(self, step: int, **_: Any) -> None:
        """Take part in the writer's snapshot of ``step``."""
        if self._written_step != step:
            self.trainer.export(reuse=True)
            self._written_step = step

    def wait(self) -> None:
        """Nothing is written here."""

    def close(self) -> None:
        """Nothing to stop."""


def lent_exports(
    trainer: Trainer, storage: Storage | None, written_step: int | None
) -> LentExports | None:
    """A non-writing rank's part in the writer's checkpoints (``written_step``: the
    resumed checkpoint's step, written already, as the writer's ``Checkpointer`` has
    it), or ``None`` when the trainer's export is no collective or nothing is written."""
    if storage is None or not trainer.exports_together:
        return None
    return LentExports(trainer, written_step)
