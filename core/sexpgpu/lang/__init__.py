"""The .sx language: reader, forms, the <core> prelude, shape checking and the compiler.

Two entry points: :func:`compile_file` for a file on disk and :func:`compile_text`
for text in hand (tests, tools). Both return a checked
:class:`sexpgpu.graph.Program` or raise a :class:`sexpgpu.errors.SexpError`.
Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sexpgpu.errors import SourceError
from sexpgpu.graph import Program

__all__ = ["compile_file", "compile_text", "core_source"]

_CORE_PATH = Path(__file__).with_name("core.sx")


def core_source() -> bytes:
    """The bytes of the `<core>` prelude that ships with the package."""
    return _CORE_PATH.read_bytes()


def compile_file(
    path: str,
    *,
    sets: Mapping[str, str] | None = None,
    variant: str | None = None,
    steps: int | None = None,
) -> Program:
    """Compile the `.sx` file at ``path`` (as the user named it) into a checked program.

    ``sets`` are ``--set name=value`` pairs typed by each knob's default,
    ``variant`` a ``defvariant`` to apply, ``steps`` sets the knob ``steps``.
    Raises :class:`SourceError` for mistakes in the sources and
    :class:`sexpgpu.errors.UsageError` for mistakes in these arguments.
    """
    try:
        data = Path(path).read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SourceError(f"cannot read {path}: {reason}") from None
    return _compile(text, data, path, os.path.realpath(path), sets, variant, steps)


def compile_text(
    text: str,
    name: str = "main.sx",
    *,
    sets: Mapping[str, str] | None = None,
    variant: str | None = None,
    steps: int | None = None,
) -> Program:
    """Compile ``text`` as if it were the file ``name`` (includes resolve from its folder)."""
    return _compile(text, text.encode("utf-8"), name, None, sets, variant, steps)


def _compile(
    text: str,
    data: bytes,
    file: str,
    resolved: str | None,
    sets: Mapping[str, str] | None,
    variant: str | None,
    steps: int | None,
) -> Program:
    from sexpgpu.lang.compiler import CORE_NAME, Compiler

    comp = Compiler(file, os.path.dirname(file) or ".")
    core = core_source()
    try:
        comp.load(core.decode("utf-8"), CORE_NAME, CORE_NAME, None, core)
        if resolved is not None:
            comp.read_paths.add(resolved)
        comp.load(text, file, os.path.basename(file), resolved, data)
        comp.settle_knobs(dict(sets or {}), variant, steps)
        return comp.build(file, variant)
    except RecursionError:
        raise SourceError(f"{file}: the program is nested too deeply to compile") from None
