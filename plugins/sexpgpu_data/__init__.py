"""Built-in data sources: generated tasks, text and token files, .npy arrays, images.

Sources (docs/data.md documents each one's options, fields and token map):
``arithmetic``, ``copy``, ``sort``, ``shapes`` (generated, endless, batch ``i`` a
pure function of ``(seed, i)``) and ``text``, ``tokens``, ``npy`` (files, shuffled
per epoch from ``(seed, epoch)``; ``npy``'s ``:holdout`` and ``:split`` divide its
records into ``"train"`` and ``"val"``). Only numpy is imported, and only when a source
is asked for (``sexpgpu --help`` and ``sexpgpu plugins`` stay fast); never torch.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from sexpgpu.extension import DataSourceInfo
from sexpgpu.hookspecs import hookimpl

from .defaults import (
    ARITH_DEFAULTS,
    NPY_DEFAULTS,
    SEQ_DEFAULTS,
    SHAPES_DEFAULTS,
    TEXT_DEFAULTS,
    TOKENS_DEFAULTS,
)

__all__ = ["DataFileError", "DataOptionError", "data_sources", "rng_for", "sexpgpu_data_sources"]


SPLIT_DOC = "a name for the stream: 'train' (default); any other name (e.g. 'eval') gives another stream from the same seed"
NPY_SPLIT_DOC = (
    "'train' (default): the records :holdout keeps; 'val': the ones it sets aside (needs :holdout)"
)


def __getattr__(name: str):
    if name in ("DataFileError", "DataOptionError", "rng_for"):
        from . import _common

        return getattr(_common, name)
    raise AttributeError(name)


def _later(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported at its first call: the loaders' modules import numpy,
    which listing the sources does not need."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(import_module(f"{__name__}.{module}"), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def data_sources() -> list[DataSourceInfo]:
    """Every built-in data source's descriptor."""
    return [
        DataSourceInfo(
            name="arithmetic",
            options=dict(ARITH_DEFAULTS),
            fields=_later("generated", "arithmetic_fields"),
            factory=_later("generated", "arithmetic_loader"),
            prompt_length=_later("generated", "arithmetic_prompt"),
            verify=_later("generated", "arithmetic_verify"),
            doc="Addition problems 'a+b=c' as tokens (vocab 16: digits 0-9, + 10, = 11, pad 12, end 13); "
            "only the answer is scored.",
            option_docs={
                "digits": "digits per operand (1-18); :seq must be at least 3*digits+3",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="copy",
            options=dict(SEQ_DEFAULTS),
            fields=_later("generated", "copy_fields"),
            factory=_later("generated", "copy_loader"),
            prompt_length=_later("generated", "seqtask_prompt"),
            verify=_later("generated", "seqtask_verify"),
            doc="Random symbols, a separator, then the same symbols again; only the copy is scored.",
            option_docs={
                "vocab": "token count (at least 4): symbols 0..vocab-3, separator vocab-2, pad vocab-1",
                "length": "symbols per prompt; 0 (default) means seq // 2",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="sort",
            options=dict(SEQ_DEFAULTS),
            fields=_later("generated", "sort_fields"),
            factory=_later("generated", "sort_loader"),
            prompt_length=_later("generated", "seqtask_prompt"),
            verify=_later("generated", "seqtask_verify"),
            doc="Random symbols, a separator, then the symbols in ascending order; only the sorted half is scored.",
            option_docs={
                "vocab": "token count (at least 4): symbols 0..vocab-3, separator vocab-2, pad vocab-1",
                "length": "symbols per prompt; 0 (default) means seq // 2",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="shapes",
            options=dict(SHAPES_DEFAULTS),
            fields=_later("generated", "shapes_fields"),
            factory=_later("generated", "shapes_loader"),
            tokens_field=None,
            doc="Noisy 1-channel images of one shape each (square, circle, cross, hbar, vbar, triangle, "
            "ring, diagonal); the target is the shape's class.",
            option_docs={
                "classes": "how many shape kinds (2-8)",
                "size": "image side in pixels (8-512)",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="text",
            options=dict(TEXT_DEFAULTS),
            fields=_later("files", "text_fields"),
            check=_later("files", "text_check"),
            factory=_later("files", "text_loader"),
            doc="A file's bytes as tokens (vocab 256), cut into windows of seq+1; targets are the next byte.",
            option_docs={"path": "the text or binary file (relative to the .sx file)"},
            path_options=("path",),
        ),
        DataSourceInfo(
            name="tokens",
            options=dict(TOKENS_DEFAULTS),
            fields=_later("files", "tokens_fields"),
            check=_later("files", "tokens_check"),
            factory=_later("files", "tokens_loader"),
            doc="A flat file of token ids (nanoGPT .bin) cut into windows of seq+1; targets are the next token.",
            option_docs={
                "path": "the token file (relative to the .sx file)",
                "dtype": "'uint16' (default) or 'uint32'",
            },
            path_options=("path",),
        ),
        DataSourceInfo(
            name="npy",
            options=dict(NPY_DEFAULTS),
            fields=_later("files", "npy_fields"),
            factory=_later("files", "npy_loader"),
            tokens_field=None,
            doc="Records from .npy arrays: features as f32, integer labels as i64 classes, "
            "float labels as f32 regression targets.",
            option_docs={
                "features": ".npy file, one record per row (any number type)",
                "labels": ".npy file, one label per record (integer: class; float: regression target)",
                "holdout": "the fraction of records (0 to below 1; default 0) set aside for :split 'val', "
                "chosen by the record count alone, never the seed",
                "split": NPY_SPLIT_DOC,
            },
            path_options=("features", "labels"),
        ),
    ]


@hookimpl
def sexpgpu_data_sources() -> list[DataSourceInfo]:
    """The built-in data sources."""
    return data_sources()
