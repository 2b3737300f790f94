"""Finding checkpoints: the latest complete step under a location, a checkpoint named
by its location, and what ``--resume`` resumes from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sexpgpu.checkpoint.keys import (
    E_MISSING,
    E_RESUME_LATEST,
    EXPERIMENT_FILE,
    FILES,
    file_key,
    location_of,
    parse_step_key,
)
from sexpgpu.errors import CheckpointError, SexpError, StorageError, UsageError

if TYPE_CHECKING:
    from sexpgpu.extension import Opener, Storage


def steps_of(storage: Storage) -> list[tuple[int, str]]:
    """(step, key) of every ``step-<n>`` child of the location, lowest first."""
    steps = []
    for name in storage.list_children(""):
        step = parse_step_key(name)
        if step is not None:
            steps.append((step, name.rstrip("/")))
    return sorted(steps)


def complete_before(storage: Storage, key: str) -> str | None:
    """The key of the highest complete ``step-<n>`` below the checkpoint ``key``, or ``None``."""
    limit = parse_step_key(key)
    for step, name in reversed(steps_of(storage)):
        if limit is not None and step < limit:
            try:
                if storage.exists(file_key(name, EXPERIMENT_FILE)):
                    return name
            except StorageError:
                continue  # a folder that is not one (a link) is no checkpoint to name
    return None


def find_latest(storage: Storage) -> str | None:
    """The key of the highest complete ``step-<n>`` under ``storage``, or ``None``.

    Names that are not ``step-<8 digits>`` are ignored, and so is a step folder
    without ``experiment.json`` (a write cut off). A location that cannot be
    listed raises :class:`sexpgpu.errors.StorageError`: never a fresh start.
    """
    for _, name in reversed(steps_of(storage)):
        if storage.exists(file_key(name, EXPERIMENT_FILE)):
            return name
    return None


def open_checkpoint(location: str, open_location: Opener) -> tuple[Storage, str]:
    """Open a checkpoint named by its location (``/tmp/run/step-00000004``,
    ``s3://bucket/prefix/step-00000004``) as (storage of its parent, key), with
    ``open_location`` (:meth:`sexpgpu.catalog.Catalog.open_location`).

    A location whose last part is not ``step-<n>`` (a copied checkpoint, or a
    checkpoint location to list) is opened itself, with the key ``""``;
    ``<location>/latest`` is the newest complete ``step-<n>`` under it, found by
    listing. Nothing else is read yet.
    """
    from sexpgpu.checkpoint.storage import scheme_of

    text = location.strip()
    trimmed = text.rstrip("/") or text
    parent, _, name = trimmed.rpartition("/")
    if name == "latest" and parent and not parent.endswith(":/"):
        storage = open_location(parent)
        key = find_latest(storage)
        if key is None:
            raise CheckpointError(
                f"there is no complete checkpoint under {storage.uri}", code=E_MISSING
            )
        return storage, key
    if parse_step_key(name) is None:
        return open_location(trimmed), ""
    if not parent or parent.endswith(":/"):
        # "step-00000004" alone is in the working directory; "s3://step-..." has no bucket.
        if scheme_of(trimmed) != "file":
            return open_location(trimmed), ""
        parent = parent or ("/" if trimmed.startswith("/") else ".")
    return open_location(parent), name


def resolve_resume(
    value: str, checkpoint_dir: str | None, open_location: Opener
) -> tuple[Storage, str] | None:
    """What ``--resume value`` resumes from: (storage, key), or ``None`` for a fresh start.

    ``latest`` takes the highest complete step under ``checkpoint_dir`` (an error
    without one; ``None`` when there is none yet). Any other value is a
    checkpoint's location, which must hold a complete checkpoint.
    """
    if value.strip() == "latest":
        if not checkpoint_dir:
            raise UsageError(
                "--resume latest needs a checkpoint location "
                "(--checkpoint-dir or SEXPGPU_CHECKPOINT_DIR)",
                code=E_RESUME_LATEST,
            )
        return _resume_latest(open_location(checkpoint_dir))
    storage, key = open_checkpoint(value, open_location)
    require_complete(storage, key)
    return storage, key


def _resume_latest(storage: Storage) -> tuple[Storage, str] | None:
    """:func:`find_latest` for ``--resume latest``: a step folder on the way that
    cannot be read (its permissions) leaves the latest step unknown, so its error
    names the complete checkpoint before it, as for a damaged one; never a silent
    resume from an older step."""
    for _, name in reversed(steps_of(storage)):
        try:
            complete = storage.exists(file_key(name, EXPERIMENT_FILE))
        except StorageError as error:
            raise latest_damaged(storage, name, error) from None
        if complete:
            return storage, name
    return None


def latest_damaged(storage: Storage, key: str, error: SexpError) -> SexpError:
    """``error`` (the latest checkpoint ``key`` cannot be read) as ``--resume latest``
    says it: the same class and code, naming the complete checkpoint before it that
    the user may pass to ``--resume``; never a silent fall-back to it."""
    before = complete_before(storage, key)
    if before is None:
        hint = "there is no complete checkpoint before it (move it aside to start afresh)"
    else:
        hint = f"to resume from the one before it, pass --resume {location_of(storage, before)}"
    return type(error)(
        f"{error.message}; --resume latest never falls back to an older checkpoint: {hint}",
        code=error.code,
    )


def require_complete(storage: Storage, key: str) -> None:
    """Nothing when ``key`` holds a complete checkpoint (its ``experiment.json``);
    otherwise :class:`CheckpointError` (``E-CKPT-001``), telling a write cut off
    from no checkpoint at all."""
    if storage.exists(file_key(key, EXPERIMENT_FILE)):
        return
    where = location_of(storage, key)
    if any(storage.exists(file_key(key, name)) for name in FILES[:-1]):
        raise CheckpointError(
            f"{where} is not a complete checkpoint: it has no {EXPERIMENT_FILE} "
            "(its writing was cut off)",
            code=E_MISSING,
        )
    raise CheckpointError(f"there is no checkpoint at {where}", code=E_MISSING)


def has_checkpoint(storage: Storage) -> bool:
    """Whether the location itself holds a checkpoint (a copied one: ``experiment.json``
    or another checkpoint file at its top), rather than ``step-<n>`` folders."""
    return any(storage.exists(name) for name in FILES)
