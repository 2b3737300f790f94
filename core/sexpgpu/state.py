"""Where a run is, as one record: what a checkpoint's ``state.json`` holds and a resume
starts from, passed by value (each committed step makes the next) and saved whole."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RunState:
    """The step committed and its stage, the records and counters so far, where the
    stage's loader is, and the eval passes due at the step that a signal stopped."""

    step: int = 0
    stage: int = 0
    records: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)
    loader: Mapping[str, Any] | None = None
    evals_pending: tuple[str, ...] = ()

    @classmethod
    def of(cls, state: Mapping[str, Any], counters: Sequence[str]) -> RunState:
        """The state a checkpoint's ``state.json`` says (``{}``: a fresh start), keeping
        the ``counters`` the program names."""
        kept = {name: 0 for name in counters}
        kept.update({k: int(v) for k, v in state.get("counters", {}).items()})
        return cls(
            step=int(state.get("step", 0)),
            stage=int(state.get("stage", 0)),
            records=int(state.get("records", 0)),
            counters=kept,
            loader=state.get("loader"),
            evals_pending=tuple(state.get("evals_pending", ())),
        )

    def stepped(
        self, step: int, stage: int, added: Mapping[str, int], loader: Mapping[str, Any] | None
    ) -> RunState:
        """The state once ``step`` of ``stage`` is committed: its batch ``added`` to the
        records and counters (:meth:`sexpgpu.batches.StageBatches.counted`), its loader
        at ``loader``."""
        counters = {k: v + added.get(k, 0) for k, v in self.counters.items()}
        records = self.records + added.get("records", 0)
        return replace(self, step=step, stage=stage, records=records, counters=counters,
                       loader=loader)  # fmt: skip

    def owing(self, passes: Sequence[str]) -> RunState:
        """The state with ``passes`` due and not yet reported."""
        return replace(self, evals_pending=tuple(passes))

    def record(self, seed: int) -> dict[str, Any]:
        """``state.json``'s content (docs/checkpoints.md)."""
        from sexpgpu.checkpoint import state_record

        return state_record(
            step=self.step, stage=self.stage, records=self.records, counters=self.counters,
            loader=self.loader, seed=seed, evals_pending=self.evals_pending,
        )  # fmt: skip
