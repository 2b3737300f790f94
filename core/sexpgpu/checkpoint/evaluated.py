"""``evaluated.json``: the steps ``sexpgpu evaluate --follow`` has evaluated at a location,
and what a run's retention keeps for a follower that has not evaluated them yet.

The file sits beside the ``step-<n>`` folders, ``{"eval":[250,500],"probe":[50,100]}``:
each pass's evaluated steps. A follower writes it when it starts (``{}`` when it has
evaluated nothing), so its being there says a follower is (or was) at the location;
it is rewritten whole after each pass. ``latest`` and ``--resume`` never read it.

Retention (``:keep-last``) would delete a checkpoint a follower has not reached yet.
While the file is there, a run keeps each old checkpoint that a pass is due at and the
file does not list, up to :data:`HOLD_DEFAULT` of them (``SEXPGPU_KEEP_UNEVALUATED``),
the oldest first, since a follower evaluates in step order; past that bound they go,
and the follower reports each due step it never saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from sexpgpu.checkpoint.keys import is_count, location_of
from sexpgpu.checkpoint.storage import NO_SUCH_LOCATION
from sexpgpu.errors import CheckpointError, StorageError

if TYPE_CHECKING:
    from sexpgpu.checkpoint.retention import StepFolder
    from sexpgpu.extension import Storage

__all__ = [
    "E_EVALUATED",
    "EVALUATED_FILE",
    "HOLD_DEFAULT",
    "HOLD_VARIABLE",
    "due_passes",
    "read_evaluated",
    "unevaluated",
    "write_evaluated",
]

EVALUATED_FILE = "evaluated.json"
E_EVALUATED = "E-EVAL-003"
"""An ``evaluated.json`` that is not what a follower writes."""
HOLD_VARIABLE = "SEXPGPU_KEEP_UNEVALUATED"
"""The environment variable that sets how many (``0``: none)."""
HOLD_DEFAULT = 8
"""How many old checkpoints a run keeps, beyond ``:keep-last``, for a follower."""
_MOST_BYTES = 64 << 20  # a follower of a million steps writes a few megabytes


def read_evaluated(storage: Storage) -> dict[str, list[int]] | None:
    """``evaluated.json`` under the location, ``None`` when there is none; one that is
    not a pass -> steps object is :data:`E_EVALUATED`, never a silent start from nothing."""
    where = location_of(storage, EVALUATED_FILE)
    try:
        # one byte past the bound is enough to refuse it: never the whole of a huge file
        data = storage.read_range(EVALUATED_FILE, 0, _MOST_BYTES + 1)
    except StorageError as error:
        if error.code == NO_SUCH_LOCATION:
            return None
        raise
    if len(data) > _MOST_BYTES:
        raise CheckpointError(_corrupt(where, f"it is over {_MOST_BYTES} bytes"), code=E_EVALUATED)
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(
            _corrupt(where, f"it is not JSON ({error})"), code=E_EVALUATED
        ) from None
    except RecursionError:
        raise CheckpointError(_corrupt(where, "it is nested too deep"), code=E_EVALUATED) from None
    if not isinstance(record, dict) or not all(
        isinstance(steps, list) and all(is_count(s) and s < 2**63 for s in steps)
        for steps in record.values()
    ):
        raise CheckpointError(
            _corrupt(where, 'it is not {"pass": [step, ...], ...}'), code=E_EVALUATED
        )
    return {str(name): sorted(set(steps)) for name, steps in record.items()}


def _corrupt(where: str, why: str) -> str:
    return (
        f"{where} is not what evaluate --follow writes: {why}; delete it to evaluate "
        "every checkpoint again"
    )


def write_evaluated(storage: Storage, evaluated: Mapping[str, Iterable[int]]) -> None:
    """Rewrite ``evaluated.json`` whole, in one object write, in the spec's compact
    form (``{"eval":[250,500],"probe":[50,100]}``)."""
    record = {name: sorted(steps) for name, steps in sorted(evaluated.items())}
    text = json.dumps(record, separators=(",", ":"))
    storage.write(EVALUATED_FILE, (text + "\n").encode())


def due_passes(passes: Sequence[tuple[str, int]], step: int) -> list[str]:
    """The names among ``passes`` (``(name, every)``) due at ``step`` (``every`` divides it)."""
    return [name for name, every in passes if every and step % every == 0]


def unevaluated(
    storage: Storage,
    old: Sequence[StepFolder],
    passes: Sequence[tuple[str, int]],
    hold: int,
) -> list[str]:
    """The keys among ``old`` (checkpoints retention would delete, oldest first) to keep
    for a follower: due for a pass ``evaluated.json`` does not list at their step, at
    most ``hold`` of them, the oldest first. None without the file; an unreadable one
    lists nothing as evaluated (its follower refuses it: the bound still holds)."""
    if hold <= 0 or not passes:
        return []
    try:
        evaluated = read_evaluated(storage)
    except CheckpointError:
        evaluated = {}
    if evaluated is None:
        return []
    done = {name: set(steps) for name, steps in evaluated.items()}
    kept = []
    for folder in old:
        if any(folder.step not in done.get(p, ()) for p in due_passes(passes, folder.step)):
            kept.append(folder.key)
            if len(kept) == hold:
                break
    return kept
