"""Built-in data sources: generated tasks, text and token files, .npy arrays, images.

Sources (docs/data.md documents each one's options, fields and token map):
``arithmetic``, ``copy``, ``sort``, ``shapes`` (generated, endless, batch ``i`` a
pure function of ``(seed, i)``) and ``text``, ``tokens``, ``npy`` (files, shuffled
per epoch from ``(seed, epoch)``). Only numpy is imported, and only when a source
is asked for (``sexpgpu --help`` and ``sexpgpu plugins`` stay fast); never torch.
"""

from __future__ import annotations

from sexpgpu.extension import DataSourceInfo
from sexpgpu.hookspecs import hookimpl

__all__ = ["DataFileError", "DataOptionError", "data_sources", "rng_for", "sexpgpu_data_sources"]


SPLIT_DOC = "a name for the stream: 'train' (default); any other name (e.g. 'eval') gives another stream from the same seed"


def __getattr__(name: str):
    if name in ("DataFileError", "DataOptionError", "rng_for"):
        from . import _common

        return getattr(_common, name)
    raise AttributeError(name)


def data_sources() -> list[DataSourceInfo]:
    """Every built-in data source's descriptor."""
    from . import files, generated

    return [
        DataSourceInfo(
            name="arithmetic",
            options=dict(generated.ARITH_DEFAULTS),
            fields=generated.arithmetic_fields,
            factory=generated.arithmetic_loader,
            doc="Addition problems 'a+b=c' as tokens (vocab 16: digits 0-9, + 10, = 11, pad 12, end 13); "
            "only the answer is scored.",
            option_docs={
                "digits": "digits per operand (1-18); :seq must be at least 3*digits+3",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="copy",
            options=dict(generated.SEQ_DEFAULTS),
            fields=generated.copy_fields,
            factory=generated.copy_loader,
            doc="Random symbols, a separator, then the same symbols again; only the copy is scored.",
            option_docs={
                "vocab": "token count (at least 4): symbols 0..vocab-3, separator vocab-2, pad vocab-1",
                "length": "symbols per prompt; 0 (default) means seq // 2",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="sort",
            options=dict(generated.SEQ_DEFAULTS),
            fields=generated.sort_fields,
            factory=generated.sort_loader,
            doc="Random symbols, a separator, then the symbols in ascending order; only the sorted half is scored.",
            option_docs={
                "vocab": "token count (at least 4): symbols 0..vocab-3, separator vocab-2, pad vocab-1",
                "length": "symbols per prompt; 0 (default) means seq // 2",
                "split": SPLIT_DOC,
            },
        ),
        DataSourceInfo(
            name="shapes",
            options=dict(generated.SHAPES_DEFAULTS),
            fields=generated.shapes_fields,
            factory=generated.shapes_loader,
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
            options=dict(files.TEXT_DEFAULTS),
            fields=files.text_fields,
            factory=files.text_loader,
            doc="A file's bytes as tokens (vocab 256), cut into windows of seq+1; targets are the next byte.",
            option_docs={"path": "the text or binary file (relative to the .sx file)"},
            path_options=("path",),
        ),
        DataSourceInfo(
            name="tokens",
            options=dict(files.TOKENS_DEFAULTS),
            fields=files.tokens_fields,
            factory=files.tokens_loader,
            doc="A flat file of token ids (nanoGPT .bin) cut into windows of seq+1; targets are the next token.",
            option_docs={
                "path": "the token file (relative to the .sx file)",
                "dtype": "'uint16' (default) or 'uint32'",
            },
            path_options=("path",),
        ),
        DataSourceInfo(
            name="npy",
            options=dict(files.NPY_DEFAULTS),
            fields=files.npy_fields,
            factory=files.npy_loader,
            tokens_field=None,
            doc="Records from .npy arrays: features as f32, integer labels as i64 classes, "
            "float labels as f32 regression targets.",
            option_docs={
                "features": ".npy file, one record per row (any number type)",
                "labels": ".npy file, one label per record (integer: class; float: regression target)",
            },
            path_options=("features", "labels"),
        ),
    ]


@hookimpl
def sexpgpu_data_sources() -> list[DataSourceInfo]:
    """The built-in data sources."""
    return data_sources()
