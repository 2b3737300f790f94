"""Shared pieces of the built-in data sources: option checking, seeded generators,
positions, and the errors they raise.

Error codes (listed in docs/data.md and docs/errors.md):

- ``E-DATA-001`` a data file is missing or cannot be read
- ``E-DATA-002`` a data file is too short for one window or one batch
- ``E-DATA-003`` a non-finite value (NaN, inf) in ``.npy`` data
- ``E-DATA-004`` ``.npy`` features and labels disagree (count, dtype)
- ``E-DATA-005`` a data option of the wrong type or out of range
- ``E-DATA-006`` a saved loader position this source cannot take
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from sexpgpu.errors import RunError, SourceError
from sexpgpu.extension import DataLoader

E_FILE = "E-DATA-001"
E_SHORT = "E-DATA-002"
E_NONFINITE = "E-DATA-003"
E_MISMATCH = "E-DATA-004"
E_OPTION = "E-DATA-005"
E_POSITION = "E-DATA-006"


class DataOptionError(SourceError):
    """A ``defdata`` option (or ``:seq``/``:batch``) that a source cannot take.

    Raised without a position: the compiler, which knows where the ``defdata``
    form is, may re-raise it with one.
    """


class DataFileError(RunError):
    """A data file that is missing, too short, or holds values a run cannot use."""


def rng_for(seed: int, name: str, *parts: Any) -> np.random.Generator:
    """A numpy Generator that is a pure function of ``(seed, "data", name, *parts)``.

    The key is hashed with sha256 (stable across processes and Python versions,
    unlike ``hash()``), so a resumed run rebuilds the same stream with no saved
    generator state.
    """
    key = json.dumps([int(seed), "data", name, *parts], separators=(",", ":"))
    digest = hashlib.sha256(key.encode()).digest()
    entropy = int.from_bytes(digest[:16], "little")
    return np.random.Generator(np.random.PCG64(entropy))


def resolve_options(
    source: str, defaults: Mapping[str, Any], options: Mapping[str, Any]
) -> dict[str, Any]:
    """The source's defaults overlaid with ``options``; unknown options are an error.

    Keys may be written as in a `.sx` file (``min-len``) or in Python (``min_len``).
    """
    merged = dict(defaults)
    for key, value in options.items():
        py_key = key.replace("-", "_")
        if py_key not in defaults:
            known = ", ".join(f":{k.replace('_', '-')}" for k in defaults) or "none"
            raise DataOptionError(
                f"data source '{source}' has no option ':{key.replace('_', '-')}' (options: {known})",
                code=E_OPTION,
            )
        merged[py_key] = value
    return merged


def _opt_label(source: str, key: str) -> str:
    return f"data source '{source}' option :{key.replace('_', '-')}"


def int_option(
    source: str, opts: Mapping[str, Any], key: str, *, low: int, high: int | None = None
) -> int:
    """``opts[key]`` as an int in ``[low, high]``; a bool, float or string is an error."""
    value = opts[key]
    # bool is an int subclass in Python: `:digits true` must not mean 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataOptionError(
            f"{_opt_label(source, key)} must be an integer, got {value!r}", code=E_OPTION
        )
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise DataOptionError(
            f"{_opt_label(source, key)} must be {bound}, got {value}", code=E_OPTION
        )
    return value


def str_option(
    source: str, opts: Mapping[str, Any], key: str, *, choices: tuple[str, ...] | None = None
) -> str:
    """``opts[key]`` as a non-empty string, one of ``choices`` when given."""
    value = opts[key]
    if not isinstance(value, str) or not value:
        what = f"one of {', '.join(repr(c) for c in choices)}" if choices else "a non-empty string"
        raise DataOptionError(
            f"{_opt_label(source, key)} must be {what}, got {value!r}", code=E_OPTION
        )
    if choices is not None and value not in choices:
        raise DataOptionError(
            f"{_opt_label(source, key)} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}",
            code=E_OPTION,
        )
    return value


def check_seq_batch(source: str, seq: int, batch: int, *, uses_seq: bool = True) -> None:
    """``:seq`` and ``:batch`` must be positive integers (``seq`` only where the source uses it)."""
    for key, value, used in (("seq", seq, uses_seq), ("batch", batch, True)):
        if not used:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise DataOptionError(
                f"data source '{source}': :{key} must be a positive integer, got {value!r}",
                code=E_OPTION,
            )


def position_int(source: str, position: Mapping[str, Any], key: str) -> int:
    """``position[key]`` as a non-negative int, or ``E-DATA-006``."""
    if not isinstance(position, Mapping) or key not in position:
        raise DataFileError(
            f"data source '{source}' cannot restore position {position!r}: no '{key}'",
            code=E_POSITION,
        )
    value = position[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataFileError(
            f"data source '{source}' cannot restore position {position!r}: "
            f"'{key}' must be a non-negative integer",
            code=E_POSITION,
        )
    return value


class GeneratedLoader(DataLoader):
    """An endless stream where batch ``i`` is ``make(rng_for(seed, name, i))``
    (``rng_for(seed, name, split, i)`` for a split other than ``train``).

    Its position is ``{"index": i}``, the number of batches already taken.
    """

    def __init__(self, name: str, seed: int, make: Any, split: str = "train") -> None:
        self._name = name
        self._seed = int(seed)
        self._make = make
        # The train stream keeps the plain key (seed, "data", name, index).
        self._key: tuple[Any, ...] = () if split == "train" else (split,)
        self._index = 0

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next batch; advances the position by one."""
        batch = self._make(rng_for(self._seed, self._name, *self._key, self._index))
        self._index += 1
        return batch

    def position(self) -> dict[str, Any]:
        """``{"index": i}``: how many batches have been taken."""
        return {"index": self._index}

    def restore(self, position: Mapping[str, Any]) -> None:
        """Continue from a position :meth:`position` returned."""
        self._index = position_int(self._name, position, "index")
