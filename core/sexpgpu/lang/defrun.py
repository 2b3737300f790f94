"""The ``defrun`` form read into its options, which the ``elaborate`` and ``plan``
passes take apart (the roots, then the settings, stages and evals)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.definitions import Definitions
from sexpgpu.lang.reader import SList, show
from sexpgpu.lang.syntax import pick_keywords, split_args
from sexpgpu.lang.text import err

__all__ = ["DEFRUN_OPTIONS", "RunForm", "read_defrun"]

DEFRUN_OPTIONS = (
    "model",
    "data",
    "loss",
    "optimizer",
    "steps",
    "checkpoint-every",
    "keep-last",
    "seed",
    "precision",
    "counters",
    "guard-finite",
    "deterministic",
    "shard",
    "stages",
    "evals",
    "with-loaded",
    "generate",
)


@dataclass(frozen=True)
class RunForm:
    """The program's ``defrun``: its name, its form and its options (unevaluated)."""

    name: str
    form: SList
    opts: Mapping[str, Any]


def read_defrun(defs: Definitions) -> RunForm:
    """The ``defrun`` of ``defs`` (there must be one), its options each known and given once."""
    form = defs.run
    if form is None:
        raise err("no (defrun ...) in this program", Pos(defs.file, 1, 1))
    positional, keywords = split_args(form.items[2:])
    if positional:
        raise err(
            f"defrun takes :keyword value pairs, got {show(positional[0])}", positional[0].pos
        )
    opts = pick_keywords(keywords, DEFRUN_OPTIONS, "defrun")
    return RunForm(form.items[1].name, form, opts)
