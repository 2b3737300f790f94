"""Each built-in source's options and their defaults.

Kept apart from the loaders so the plugin's descriptors (``sexpgpu plugins``,
``sexpgpu --help``) are built without importing numpy.
"""

from __future__ import annotations

from typing import Any

ARITH_DEFAULTS: dict[str, Any] = {"digits": 3, "split": "train"}
SEQ_DEFAULTS: dict[str, Any] = {"vocab": 16, "length": 0, "split": "train"}
SHAPES_DEFAULTS: dict[str, Any] = {"classes": 4, "size": 16, "split": "train"}
TEXT_DEFAULTS: dict[str, Any] = {"path": ""}
TOKENS_DEFAULTS: dict[str, Any] = {"path": "", "dtype": "uint16"}
TOKEN_DTYPES = ("uint16", "uint32")
NPY_DEFAULTS: dict[str, Any] = {"features": "", "labels": "", "holdout": 0.0, "split": "train"}
NPY_SPLITS = ("train", "val")
