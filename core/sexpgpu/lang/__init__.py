"""The .sx language: reader, forms, the <core> prelude, shape checking and the compiler.

Two entry points: :func:`compile_file` for a file on disk and :func:`compile_text`
for text in hand (tests, tools). Both take the :class:`sexpgpu.catalog.Catalog` of
what plugins supply (data sources, optimizers, ops, eval metrics, storage schemes),
and return a checked :class:`sexpgpu.lang.ir.Program` or raise a
:class:`sexpgpu.errors.SexpError`. The compiler is a sequence of passes with typed
results (:mod:`sexpgpu.lang.pipeline` lists them). Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sexpgpu.errors import SourceError
from sexpgpu.lang.ir import Program

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.syntax import FileCheck

__all__ = ["compile_file", "compile_text", "core_source"]

_CORE_PATH = Path(__file__).with_name("core.sx")

# The compiler recurses over the forms, a dozen Python frames per level at most:
# enough frames, and a thread stack to hold them, for the reader's limit.
_FRAMES_PER_LEVEL = 16
_STACK_BYTES = 512 * 1024 * 1024

R = TypeVar("R")


def core_source() -> bytes:
    """The bytes of the `<core>` prelude that ships with the package."""
    return _CORE_PATH.read_bytes()


def compile_file(
    path: str,
    *,
    catalog: Catalog,
    sets: Mapping[str, str] | None = None,
    variant: str | None = None,
    steps: int | None = None,
    check_files: bool = True,
    files: FileCheck | None = None,
) -> Program:
    """Compile the `.sx` file at ``path`` (as the user named it) into a checked program.

    ``sets`` are ``--set name=value`` pairs typed by each knob's default,
    ``variant`` a ``defvariant`` to apply, ``steps`` sets the knob ``steps``.
    ``check_files`` checks every ``defdata``'s files (``False``: only what its
    types need, for an evaluator that reads only its passes' data).
    ``files`` refuses a file the program names that it may not read (see
    :data:`~sexpgpu.lang.syntax.FileCheck`), before anything reads it.
    Raises :class:`SourceError` for mistakes in the sources and
    :class:`sexpgpu.errors.UsageError` for mistakes in these arguments.
    """
    from sexpgpu.lang.collect import read_source_file

    try:
        # the file named on the command line is bounded like an included one
        data = read_source_file(path)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SourceError(f"cannot read {path}: {reason}") from None
    return _compile(
        text, data, path, os.path.realpath(path), catalog, sets, variant, steps, check_files, files
    )


def compile_text(
    text: str,
    name: str = "main.sx",
    *,
    catalog: Catalog,
    sets: Mapping[str, str] | None = None,
    variant: str | None = None,
    steps: int | None = None,
) -> Program:
    """Compile ``text`` as if it were the file ``name`` (includes resolve from its folder)."""
    return _compile(text, text.encode("utf-8"), name, None, catalog, sets, variant, steps, True)


def _compile(
    text: str,
    data: bytes,
    file: str,
    resolved: str | None,
    catalog: Catalog,
    sets: Mapping[str, str] | None,
    variant: str | None,
    steps: int | None,
    check_files: bool,
    files: FileCheck | None = None,
) -> Program:
    from sexpgpu.lang.definitions import CORE_NAME, SourceText
    from sexpgpu.lang.pipeline import compile_program

    core_data = core_source()
    core = SourceText(core_data.decode("utf-8"), core_data, CORE_NAME, CORE_NAME, None)
    main = SourceText(text, data, file, os.path.basename(file), resolved)

    def compile_all() -> Program:
        return compile_program(
            core, main, catalog, dict(sets or {}), variant, steps,
            check_files=check_files, files=files,
        )  # fmt: skip

    try:
        return _with_deep_stack(compile_all)
    except RecursionError:  # not reached within the reader's limit; told with a place if so
        from sexpgpu.lang.reader import MAX_NESTING, deepest, read

        raise SourceError(
            f"the program is nested too deeply to compile (the limit is {MAX_NESTING} levels)",
            pos=deepest(read(text, file)),
        ) from None


def _with_deep_stack(fn: Callable[[], R]) -> R:
    """``fn()`` in a thread whose stack and recursion limit take the reader's deepest
    nesting (:data:`sexpgpu.lang.reader.MAX_NESTING`); its exception, if any, re-raised."""
    from sexpgpu.lang.reader import MAX_NESTING

    outcome: dict[str, Any] = {}

    def target() -> None:
        before = sys.getrecursionlimit()
        sys.setrecursionlimit(max(before, MAX_NESTING * _FRAMES_PER_LEVEL))
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the calling thread as it is
            outcome["error"] = exc
        finally:
            sys.setrecursionlimit(before)

    size = threading.stack_size(_STACK_BYTES)
    try:
        worker = threading.Thread(target=target, name="sexpgpu-compile", daemon=True)
        worker.start()
    except (RuntimeError, MemoryError):  # no room for the stack here: compile as deep as we can
        target()
        worker = None
    finally:
        threading.stack_size(size)
    if worker is not None:
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
