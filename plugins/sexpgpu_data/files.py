"""File data sources: ``text`` (bytes), ``tokens`` (a nanoGPT-style ``.bin``) and ``npy``.

Each epoch visits every window (or record) once, in an order drawn from
``(seed, epoch)``; a short last batch is dropped. ``npy``'s ``:holdout`` splits its
records once, by a rule of the record count alone, into ``"train"`` and ``"val"``. The position is
``{"epoch": e, "index": i}``: ``i`` batches of epoch ``e`` have been taken.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sexpgpu.extension import DataLoader
from sexpgpu.lang.ir import TensorType

from ._common import (
    E_FILE,
    E_MISMATCH,
    E_NONFINITE,
    E_OPTION,
    E_SHORT,
    DataFileError,
    DataOptionError,
    check_seq_batch,
    position_int,
    resolve_options,
    rng_for,
    str_option,
)
from .defaults import NPY_DEFAULTS, NPY_SPLITS, TEXT_DEFAULTS, TOKEN_DTYPES, TOKENS_DEFAULTS


class EpochLoader(DataLoader):
    """Batches of ``batch`` items out of ``count``, reshuffled every epoch from ``(seed, epoch)``.

    ``take(indices)`` turns a sorted-by-order array of item numbers into a batch.
    """

    def __init__(
        self,
        name: str,
        seed: int,
        count: int,
        batch: int,
        take: Callable[[np.ndarray], dict[str, np.ndarray]],
    ) -> None:
        self._name = name
        self._seed = int(seed)
        self._count = count
        self._batch = batch
        self._take = take
        self.batches_per_epoch = count // batch
        """Full batches in one epoch (the rest of the shuffled items are skipped)."""
        self._epoch = 0
        self._index = 0
        self._order: np.ndarray | None = None

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order_epoch != epoch:
            self._order = rng_for(self._seed, self._name, "epoch", epoch).permutation(self._count)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next batch of the current epoch; moves to the next epoch after its last batch."""
        return self.next_part(0, 1)

    def next_part(self, part: int, parts: int) -> dict[str, np.ndarray]:
        """Block ``part`` of ``parts`` equal blocks of the next batch's rows, the only
        items read (a rank of several builds its own); moves as ``next_batch`` does."""
        order = self._order_for(self._epoch)
        picked = order[self._index * self._batch : (self._index + 1) * self._batch]
        share = len(picked) // parts
        batch = self._take(picked[part * share : (part + 1) * share])
        self._index += 1
        if self._index >= self.batches_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return batch

    def position(self) -> dict[str, Any]:
        """``{"epoch": e, "index": i}``: the next batch is batch ``i`` of epoch ``e``."""
        return {"epoch": self._epoch, "index": self._index}

    def restore(self, position: Mapping[str, Any]) -> None:
        """Continue from a position :meth:`position` returned."""
        epoch = position_int(self._name, position, "epoch")
        index = position_int(self._name, position, "index")
        if index > self.batches_per_epoch:
            raise DataFileError(
                f"data source '{self._name}' cannot restore position {dict(position)!r}: an epoch "
                f"of this data has {self.batches_per_epoch} batches (did the data file change?)",
                code="E-DATA-006",
            )
        if index == self.batches_per_epoch:
            epoch, index = epoch + 1, 0
        self._epoch, self._index = epoch, index


# ---------------------------------------------------------------- text and tokens


def _path_option(name: str, opts: Mapping[str, Any]) -> str:
    return os.path.expanduser(str_option(name, opts, "path"))


def _file_size(name: str, path: str) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataFileError(f"data source '{name}': no such file {path!r}", code=E_FILE) from None
    except OSError as e:
        raise DataFileError(
            f"data source '{name}': cannot read {path!r}: {e.strerror}", code=E_FILE
        ) from None
    if not os.path.isfile(path):
        raise DataFileError(f"data source '{name}': {path!r} is not a file", code=E_FILE)
    return st.st_size


def _window_count(name: str, path: str, n: int, seq: int, batch: int, unit: str) -> int:
    """Windows of ``seq + 1`` items starting every ``seq`` items; at least one batch of them."""
    windows = (n - 1) // seq if n > 0 else 0
    if windows < batch:
        need = batch * seq + 1
        raise DataFileError(
            f"data source '{name}': {path!r} holds {n} {unit}, too short for one batch "
            f"of {batch} windows of {seq}+1 (needs at least {need})",
            code=E_SHORT,
        )
    return windows


def _window_options(
    name: str, defaults: Mapping[str, Any], options: Mapping[str, Any], seq: int, batch: int
) -> tuple[str, str]:
    """The file's path and its item type, the options checked (no file is opened)."""
    opts = resolve_options(name, defaults, options)
    check_seq_batch(name, seq, batch)
    path = _path_option(name, opts)
    if name == "tokens":
        return path, str_option(name, opts, "dtype", choices=TOKEN_DTYPES)
    return path, "uint8"


def _window_check(
    name: str, defaults: Mapping[str, Any], options: Mapping[str, Any], seq: int, batch: int
):
    path, dtype = _window_options(name, defaults, options, seq, batch)
    if name == "tokens":
        itemsize = np.dtype(dtype).itemsize
        size = _file_size(name, path)
        if size % itemsize:
            raise DataFileError(
                f"data source 'tokens': {path!r} is {size} bytes, not a whole number of {dtype} tokens",
                code=E_SHORT,
            )
        n, unit = size // itemsize, "tokens"
    else:
        n, unit = _file_size(name, path), "bytes"
    windows = _window_count(name, path, n, seq, batch, unit)
    return path, dtype, n, windows


def _window_fields(name: str, defaults: Mapping[str, Any]):
    def fields(options: Mapping[str, Any], seq: int, batch: int) -> dict[str, TensorType]:
        _window_options(name, defaults, options, seq, batch)
        return {
            "inputs": TensorType((batch, seq), "i64"),
            "targets": TensorType((batch, seq), "i64"),
        }

    fields.__doc__ = f"``inputs``/``targets`` i64 ``[batch, seq]`` for ``{name}``; opens no file."
    return fields


def _window_file_check(name: str, defaults: Mapping[str, Any]):
    def check(options: Mapping[str, Any], seq: int, batch: int) -> None:
        _window_check(name, defaults, options, seq, batch)

    check.__doc__ = f"Raise if ``{name}``'s file is missing, unreadable or too short for a batch."
    return check


def _window_loader(name: str, defaults: Mapping[str, Any]):
    def factory(options: Mapping[str, Any], seq: int, batch: int, seed: int) -> EpochLoader:
        path, dtype, n, windows = _window_check(name, defaults, options, seq, batch)
        try:
            data = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
        except OSError as e:
            raise DataFileError(
                f"data source '{name}': cannot read {path!r}: {e.strerror}", code=E_FILE
            ) from None
        offsets = np.arange(seq + 1, dtype=np.int64)

        def take(picked: np.ndarray) -> dict[str, np.ndarray]:
            # Fancy indexing of the memmap copies only the chosen windows into memory.
            rows = data[(picked.astype(np.int64) * seq)[:, None] + offsets[None, :]].astype(
                np.int64
            )
            return {
                "inputs": np.ascontiguousarray(rows[:, :-1]),
                "targets": np.ascontiguousarray(rows[:, 1:]),
            }

        return EpochLoader(name, seed, windows, batch, take)

    factory.__doc__ = f"Open ``{name}``: windows of ``seq + 1`` read through a memory map."
    return factory


text_fields = _window_fields("text", TEXT_DEFAULTS)
text_check = _window_file_check("text", TEXT_DEFAULTS)
text_loader = _window_loader("text", TEXT_DEFAULTS)
tokens_fields = _window_fields("tokens", TOKENS_DEFAULTS)
tokens_check = _window_file_check("tokens", TOKENS_DEFAULTS)
tokens_loader = _window_loader("tokens", TOKENS_DEFAULTS)


# ---------------------------------------------------------------- npy


def _open_npy(path: str, what: str) -> np.ndarray:
    """The array at ``path`` memory-mapped (only its header is read now)."""
    _file_size("npy", path)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataFileError(
            f"data source 'npy': {what} {path!r} is not a readable .npy array: {reason}",
            code=E_FILE,
        ) from None
    if not isinstance(arr, np.ndarray) or arr.ndim == 0:
        raise DataFileError(
            f"data source 'npy': {what} {path!r} must be an array with one row per record",
            code=E_FILE,
        )
    if arr.dtype.kind not in "biuf":
        raise DataFileError(
            f"data source 'npy': {what} {path!r} has dtype {arr.dtype}, not a number type",
            code=E_MISMATCH,
        )
    return arr


def _holdout_option(opts: Mapping[str, Any]) -> float:
    """``:holdout`` as a fraction in ``[0, 1)``; a bool or string is an error."""
    value = opts["holdout"]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise DataOptionError(
            f"data source 'npy' option :holdout must be a number, got {value!r}", code=E_OPTION
        )
    value = float(value)
    if not 0.0 <= value < 1.0:  # also refuses NaN
        raise DataOptionError(
            f"data source 'npy' option :holdout must be at least 0 and below 1, got {value!r}",
            code=E_OPTION,
        )
    return value


def _npy_split(opts: Mapping[str, Any]) -> tuple[float, str]:
    """``(holdout, split)``, checked; ``:split "val"`` needs a ``:holdout``."""
    holdout = _holdout_option(opts)
    split = str_option("npy", opts, "split", choices=NPY_SPLITS)
    if split == "val" and holdout == 0.0:
        raise DataOptionError(
            "data source 'npy' option :split \"val\" takes the records :holdout sets aside; "
            "give :holdout, e.g. 0.1",
            code=E_OPTION,
        )
    return holdout, split


def _held_out(count: int, holdout: float) -> int:
    """How many of ``count`` records ``:holdout`` sets aside for ``:split "val"``."""
    return round(holdout * count)


def _split_records(count: int, holdout: float, split: str) -> np.ndarray:
    """The record numbers (ascending) of ``split``.

    The partition depends only on ``count`` and ``holdout``, never on the run's seed
    (an eval pass opens its data with seed + 1): the first ``round(holdout * count)``
    records of a permutation drawn from the constant key ``(0, "npy", "holdout", count)``
    are ``"val"``, the rest ``"train"``.
    """
    n_val = _held_out(count, holdout)
    order = rng_for(0, "npy", "holdout", count).permutation(count)
    return np.sort(order[:n_val] if split == "val" else order[n_val:])


def _npy_check(
    options: Mapping[str, Any], seq: int, batch: int
) -> tuple[np.ndarray, np.ndarray, float, str]:
    """The memory-mapped features and labels, ``:holdout`` and ``:split``, all checked."""
    opts = resolve_options("npy", NPY_DEFAULTS, options)
    check_seq_batch("npy", seq, batch, uses_seq=False)
    fpath = os.path.expanduser(str_option("npy", opts, "features"))
    lpath = os.path.expanduser(str_option("npy", opts, "labels"))
    holdout, split = _npy_split(opts)
    features = _open_npy(fpath, "features")
    labels = _open_npy(lpath, "labels")
    if features.shape[0] != labels.shape[0]:
        raise DataFileError(
            f"data source 'npy': {fpath!r} has {features.shape[0]} records but {lpath!r} has {labels.shape[0]} labels",
            code=E_MISMATCH,
        )
    if labels.dtype.kind != "f" and labels.ndim != 1:
        raise DataFileError(
            f"data source 'npy': integer labels {lpath!r} must be one class per record, got shape {list(labels.shape)}",
            code=E_MISMATCH,
        )
    count = features.shape[0]
    if count < batch:
        raise DataFileError(
            f"data source 'npy': {fpath!r} has {count} records, too few for one batch of {batch}",
            code=E_SHORT,
        )
    if holdout:
        n_val = _held_out(count, holdout)
        n_split = n_val if split == "val" else count - n_val
        if n_split < batch:
            raise DataFileError(
                f"data source 'npy': :split {split!r} of {fpath!r} has {n_split} of its {count} "
                f"records (:holdout {holdout:g}), too few for one batch of {batch}",
                code=E_SHORT,
            )
    return features, labels, holdout, split


def npy_fields(options: Mapping[str, Any], seq: int, batch: int) -> dict[str, TensorType]:
    """``inputs`` f32 ``[batch, *feature_shape]``; ``targets`` i64 ``[batch]`` for integer labels,
    f32 ``[batch, *label_shape]`` for float labels (regression). Reads the headers only."""
    features, labels, _, _ = _npy_check(options, seq, batch)
    if labels.dtype.kind == "f":
        target = TensorType((batch, *labels.shape[1:]), "f32")
    else:
        target = TensorType((batch,), "i64")
    return {"inputs": TensorType((batch, *features.shape[1:]), "f32"), "targets": target}


def _find_non_finite(arr: np.ndarray, path: str, what: str) -> None:
    """Scan in chunks (the array may be larger than memory) for NaN or inf."""
    if arr.dtype.kind != "f":
        return
    rows = arr.shape[0]
    per_row = max(1, int(np.prod(arr.shape[1:], dtype=np.int64)))
    step = max(1, (1 << 22) // per_row)
    for start in range(0, rows, step):
        chunk = np.asarray(arr[start : start + step])
        finite = np.isfinite(chunk)
        if not finite.all():
            bad = np.argwhere(~finite)[0]
            record = start + int(bad[0])
            value = chunk[tuple(bad)]
            raise DataFileError(
                f"data source 'npy': {what} {path!r} holds {value} at record {record} (non-finite values cannot train)",
                code=E_NONFINITE,
            )
        if float(np.abs(chunk).max(initial=0.0)) > float(np.finfo(np.float32).max):
            raise DataFileError(
                f"data source 'npy': {what} {path!r} holds values beyond float32 range (they become inf)",
                code=E_NONFINITE,
            )


def npy_loader(options: Mapping[str, Any], seq: int, batch: int, seed: int) -> EpochLoader:
    """Open ``npy``: records (of ``:split`` when ``:holdout`` sets some aside) shuffled per
    epoch; every value is checked finite once, up front."""
    features, labels, holdout, split = _npy_check(options, seq, batch)
    opts = resolve_options("npy", NPY_DEFAULTS, options)
    _find_non_finite(features, opts["features"], "features")
    _find_non_finite(labels, opts["labels"], "labels")
    regression = labels.dtype.kind == "f"
    # Without :holdout the epoch order indexes the records themselves, as it always has.
    records = _split_records(features.shape[0], holdout, split) if holdout else None

    def take(picked: np.ndarray) -> dict[str, np.ndarray]:
        if records is not None:
            picked = records[picked]
        x = np.ascontiguousarray(features[picked], dtype=np.float32)
        y = labels[picked]
        y = np.ascontiguousarray(y, dtype=np.float32 if regression else np.int64)
        return {"inputs": x, "targets": y}

    count = features.shape[0] if records is None else len(records)
    return EpochLoader("npy", seed, count, batch, take)
