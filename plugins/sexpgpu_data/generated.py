"""Generated data sources: ``arithmetic``, ``copy``, ``sort`` and ``shapes``.

Each is an endless stream; batch ``i`` is a pure function of ``(seed, i)``.
Sequence tasks give ``inputs`` (tokens ``0..seq-1`` of a row) and ``targets``
(tokens ``1..seq``, the next token) with ``-1`` wherever the next token is not
part of the answer, so cross-entropy only scores the answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sexpgpu.lang.ir import TensorType

from ._common import (
    E_OPTION,
    DataOptionError,
    GeneratedLoader,
    check_seq_batch,
    int_option,
    resolve_options,
    str_option,
)
from .defaults import ARITH_DEFAULTS, SEQ_DEFAULTS, SHAPES_DEFAULTS

IGNORE = -1
"""The target value cross-entropy skips."""


def _split_of(name: str, defaults: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """The ``:split`` option: another split is another stream from the same seed."""
    return str_option(name, resolve_options(name, defaults, options), "split")


# ---------------------------------------------------------------- arithmetic

ARITH_PLUS = 10
ARITH_EQUALS = 11
ARITH_PAD = 12
ARITH_END = 13
ARITH_VOCAB = 16


def arithmetic_length(digits: int) -> int:
    """Tokens in one problem: ``a + b = c <end>`` with ``c`` one digit wider."""
    return 3 * digits + 4


def _arith_check(options: Mapping[str, Any], seq: int, batch: int) -> int:
    opts = resolve_options("arithmetic", ARITH_DEFAULTS, options)
    check_seq_batch("arithmetic", seq, batch)
    str_option("arithmetic", opts, "split")
    # 18 digits keeps a + b inside int64.
    digits = int_option("arithmetic", opts, "digits", low=1, high=18)
    need = arithmetic_length(digits) - 1
    if seq < need:
        raise DataOptionError(
            f"data source 'arithmetic' with :digits {digits} needs :seq of at least {need} "
            f"(one problem is {need + 1} tokens), got {seq}",
            code=E_OPTION,
        )
    return digits


def _seq_fields(seq: int, batch: int) -> dict[str, TensorType]:
    return {
        "inputs": TensorType((batch, seq), "i64"),
        "targets": TensorType((batch, seq), "i64"),
    }


def arithmetic_fields(options: Mapping[str, Any], seq: int, batch: int) -> dict[str, TensorType]:
    """``inputs``/``targets`` i64 ``[batch, seq]``; checks ``:digits`` against ``:seq``."""
    _arith_check(options, seq, batch)
    return _seq_fields(seq, batch)


def _digits_of(values: np.ndarray, width: int) -> np.ndarray:
    """Each value written in ``width`` decimal digits, most significant first."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return (values[:, None] // powers[None, :]) % 10


def _split(rows: np.ndarray, seq: int, answer_from: int, answer_to: int) -> dict[str, np.ndarray]:
    """Cut full rows (``seq + 1`` tokens) into inputs and masked next-token targets.

    Target ``t`` is row token ``t + 1``; it is kept only when ``t + 1`` lies in
    ``[answer_from, answer_to)``.
    """
    inputs = np.ascontiguousarray(rows[:, :seq])
    targets = np.full_like(inputs, IGNORE)
    targets[:, answer_from - 1 : answer_to - 1] = rows[:, answer_from:answer_to]
    return {"inputs": inputs, "targets": targets}


def arithmetic_loader(
    options: Mapping[str, Any], seq: int, batch: int, seed: int
) -> GeneratedLoader:
    """Rows ``a + b = c <end> <pad>...``, operands zero-padded to ``digits``, ``c`` to ``digits + 1``."""
    digits = _arith_check(options, seq, batch)
    length = arithmetic_length(digits)
    eq_at = 2 * digits + 1

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        a = rng.integers(0, 10**digits, size=batch, dtype=np.int64)
        b = rng.integers(0, 10**digits, size=batch, dtype=np.int64)
        rows = np.full((batch, seq + 1), ARITH_PAD, dtype=np.int64)
        rows[:, :digits] = _digits_of(a, digits)
        rows[:, digits] = ARITH_PLUS
        rows[:, digits + 1 : eq_at] = _digits_of(b, digits)
        rows[:, eq_at] = ARITH_EQUALS
        rows[:, eq_at + 1 : length - 1] = _digits_of(a + b, digits + 1)
        rows[:, length - 1] = ARITH_END
        # The answer digits and the end token are scored; the operands are given.
        return _split(rows, seq, eq_at + 1, length)

    return GeneratedLoader(
        "arithmetic", seed, make, _split_of("arithmetic", ARITH_DEFAULTS, options)
    )


def arithmetic_prompt(options: Mapping[str, Any], seq: int) -> int:
    """``a + b =``: the operands and both signs."""
    return 2 * int(resolve_options("arithmetic", ARITH_DEFAULTS, options)["digits"]) + 2


def arithmetic_verify(
    options: Mapping[str, Any], seq: int, records: Mapping[str, np.ndarray]
) -> np.ndarray:
    """The share of the answer (its digits and the end token) the completion gets right."""
    digits = int(resolve_options("arithmetic", ARITH_DEFAULTS, options)["digits"])
    return _answer_match(records, arithmetic_prompt(options, seq), digits + 2)


def _answer_match(records: Mapping[str, np.ndarray], prompt: int, answer: int) -> np.ndarray:
    """Per record, the share of the ``answer`` tokens after the ``prompt`` that the
    completion has at their places (the scored targets say what they are); a
    completion shorter than the answer misses the rest."""
    wanted = records["targets"][:, prompt - 1 : prompt - 1 + answer]
    made = records["completion"][:, :answer]
    right = (made == wanted[:, : made.shape[1]]).sum(axis=1)
    return (right / answer).astype(np.float32)


# ---------------------------------------------------------------- copy and sort


def _seqtask_check(name: str, options: Mapping[str, Any], seq: int, batch: int) -> tuple[int, int]:
    opts = resolve_options(name, SEQ_DEFAULTS, options)
    check_seq_batch(name, seq, batch)
    str_option(name, opts, "split")
    vocab = int_option(name, opts, "vocab", low=4)
    length = int_option(name, opts, "length", low=0)
    longest = seq // 2
    if longest < 1:
        raise DataOptionError(
            f"data source '{name}' needs :seq of at least 2, got {seq}", code=E_OPTION
        )
    if length == 0:
        length = longest
    elif length > longest:
        raise DataOptionError(
            f"data source '{name}' with :length {length} needs :seq of at least {2 * length}, got {seq}",
            code=E_OPTION,
        )
    return vocab, length


def _seqtask_fields(name: str):
    def fields(options: Mapping[str, Any], seq: int, batch: int) -> dict[str, TensorType]:
        _seqtask_check(name, options, seq, batch)
        return _seq_fields(seq, batch)

    fields.__doc__ = f"``inputs``/``targets`` i64 ``[batch, seq]`` for ``{name}``."
    return fields


def _seqtask_loader(name: str):
    def factory(options: Mapping[str, Any], seq: int, batch: int, seed: int) -> GeneratedLoader:
        vocab, length = _seqtask_check(name, options, seq, batch)
        sep, pad = vocab - 2, vocab - 1

        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            prompt = rng.integers(0, vocab - 2, size=(batch, length), dtype=np.int64)
            answer = np.sort(prompt, axis=1) if name == "sort" else prompt
            rows = np.full((batch, seq + 1), pad, dtype=np.int64)
            rows[:, :length] = prompt
            rows[:, length] = sep
            rows[:, length + 1 : 2 * length + 1] = answer
            return _split(rows, seq, length + 1, 2 * length + 1)

        return GeneratedLoader(name, seed, make, _split_of(name, SEQ_DEFAULTS, options))

    factory.__doc__ = f"Rows ``x <sep> {name}(x) <pad>...`` of random symbols."
    return factory


def _seqtask_length(name: str, options: Mapping[str, Any], seq: int) -> int:
    length = int(resolve_options(name, SEQ_DEFAULTS, options)["length"])
    return length or seq // 2


def seqtask_prompt(options: Mapping[str, Any], seq: int) -> int:
    """The symbols and the separator (``copy`` and ``sort`` alike)."""
    return _seqtask_length("sort", options, seq) + 1


def seqtask_verify(
    options: Mapping[str, Any], seq: int, records: Mapping[str, np.ndarray]
) -> np.ndarray:
    """The share of the copied (or sorted) symbols the completion gets right, in place."""
    length = _seqtask_length("sort", options, seq)
    return _answer_match(records, length + 1, length)


copy_fields = _seqtask_fields("copy")
copy_loader = _seqtask_loader("copy")
sort_fields = _seqtask_fields("sort")
sort_loader = _seqtask_loader("sort")


# ---------------------------------------------------------------- shapes

SHAPE_NAMES = ("square", "circle", "cross", "hbar", "vbar", "triangle", "ring", "diagonal")
"""Class ``k`` draws ``SHAPE_NAMES[k]``; ``:classes N`` uses the first ``N``."""


def _shapes_check(options: Mapping[str, Any], seq: int, batch: int) -> tuple[int, int]:
    opts = resolve_options("shapes", SHAPES_DEFAULTS, options)
    check_seq_batch("shapes", seq, batch, uses_seq=False)
    str_option("shapes", opts, "split")
    classes = int_option("shapes", opts, "classes", low=2, high=len(SHAPE_NAMES))
    size = int_option("shapes", opts, "size", low=8, high=512)
    return classes, size


def shapes_fields(options: Mapping[str, Any], seq: int, batch: int) -> dict[str, TensorType]:
    """``inputs`` f32 ``[batch, 1, size, size]`` and ``targets`` i64 ``[batch]``; ``seq`` is unused."""
    _, size = _shapes_check(options, seq, batch)
    return {
        "inputs": TensorType((batch, 1, size, size), "f32"),
        "targets": TensorType((batch,), "i64"),
    }


def _draw(kind: int, yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, r: float) -> np.ndarray:
    """A 0/1 mask of shape ``kind`` centred at (cy, cx) with half-extent ``r`` pixels."""
    dy, dx = yy - cy, xx - cx
    ady, adx = np.abs(dy), np.abs(dx)
    thick = max(1.0, r / 3.0)
    name = SHAPE_NAMES[kind]
    if name == "square":
        m = (ady <= r) & (adx <= r)
    elif name == "circle":
        m = dy * dy + dx * dx <= r * r
    elif name == "cross":
        m = ((ady <= thick / 2) & (adx <= r)) | ((adx <= thick / 2) & (ady <= r))
    elif name == "hbar":
        m = (ady <= thick / 2) & (adx <= r)
    elif name == "vbar":
        m = (adx <= thick / 2) & (ady <= r)
    elif name == "triangle":
        # Apex up: the half-width grows from 0 at the top to r at the bottom.
        m = (dy >= -r) & (dy <= r) & (adx <= (dy + r) / 2)
    elif name == "ring":
        d2 = dy * dy + dx * dx
        m = (d2 <= r * r) & (d2 >= (r - thick) ** 2)
    else:  # diagonal: an X
        m = (
            ((np.abs(dy - dx) <= thick / 2) | (np.abs(dy + dx) <= thick / 2))
            & (ady <= r)
            & (adx <= r)
        )
    return m.astype(np.float32)


def shapes_loader(options: Mapping[str, Any], seq: int, batch: int, seed: int) -> GeneratedLoader:
    """Images of one random shape each (position, size, brightness, noise vary)."""
    classes, size = _shapes_check(options, seq, batch)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    r_low, r_high = max(2.0, size / 6), max(3.0, size / 3)

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        labels = rng.integers(0, classes, size=batch, dtype=np.int64)
        radius = rng.uniform(r_low, r_high, size=batch)
        # Keep every shape wholly inside the image.
        cy = rng.uniform(radius, size - 1 - radius)
        cx = rng.uniform(radius, size - 1 - radius)
        level = rng.uniform(0.6, 1.0, size=batch)
        noise = rng.normal(0.0, 0.1, size=(batch, 1, size, size)).astype(np.float32)
        images = noise
        for k in range(batch):
            images[k, 0] += level[k] * _draw(int(labels[k]), yy, xx, cy[k], cx[k], radius[k])
        return {"inputs": images.astype(np.float32, copy=False), "targets": labels}

    return GeneratedLoader("shapes", seed, make, _split_of("shapes", SHAPES_DEFAULTS, options))
