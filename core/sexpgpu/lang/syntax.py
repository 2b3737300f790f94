"""The shapes forms share: positional then ``:keyword value`` arguments, keywords
picked from a known set, ``(head name :key value ...)`` forms, and file locations
written relative to the file that writes them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from sexpgpu.errors import Pos, SexpError, SourceError
from sexpgpu.lang.definitions import CORE_NAME
from sexpgpu.lang.reader import Kw, SList, Sym, show
from sexpgpu.lang.text import err, suggest


def relative_to_file(location: Any, pos: Pos) -> Any:
    """A file ``location`` written at ``pos``: a relative path is taken relative to
    the `.sx` file that writes it (as ``include`` is), so a run reads the same files
    from any working folder; a URI, an absolute path or ``~`` is kept as it is."""
    if not isinstance(location, str) or not location or pos.file == CORE_NAME:
        return location
    if "://" in location or location.startswith("~") or os.path.isabs(location):
        return location
    return os.path.normpath(os.path.join(os.path.dirname(pos.file), location))


FileCheck = Callable[[str, str], None]
"""What refuses a file a program may not name: called with what the file is for
(``include``, ``load`` or ``data``) and its location as the compiler resolved it (a
relative path made relative to the file that names it), before anything reads it;
raises :class:`SexpError` to refuse it. A bundle's run passes its closed world."""


def checked_location(files: FileCheck | None, what: str, location: Any, pos: Pos) -> Any:
    """``location`` once ``files`` (if any) takes it; its refusal is placed at ``pos``."""
    if files is not None and isinstance(location, str):
        try:
            files(what, location)
        except SexpError as exc:
            raise SourceError(exc.message, code=exc.code, pos=pos) from None
    return location


def named_form(
    form: Any, head: str, usage: str, taken: set[str], allowed: tuple[str, ...]
) -> tuple[Sym, dict[str, Any]]:
    """``(head name :key value ...)``: its name (new among ``taken``, which it joins)
    and its keywords, each one of ``allowed``."""
    if not (
        isinstance(form, SList)
        and len(form.items) >= 2
        and isinstance(form.items[0], Sym)
        and form.items[0].name == head
        and isinstance(form.items[1], Sym)
    ):
        article = "an" if head[0] in "aeiou" else "a"
        what = "eval pass" if head == "eval" else head
        raise err(f"{article} {what} is {usage}, got {show(form)}", form.pos)
    name = form.items[1]
    if name.name in taken:
        what = "eval pass" if head == "eval" else head
        raise err(f"{what} '{name.name}' is listed twice", name.pos)
    taken.add(name.name)
    positional, keywords = split_args(form.items[2:])
    if positional:
        raise err(
            f"{head} takes :keyword value pairs, got {show(positional[0])}", positional[0].pos
        )
    return name, pick_keywords(keywords, allowed, head)


def split_args(items: Iterable[Any]) -> tuple[list[Any], list[tuple[Kw, Any]]]:
    """Positional arguments, then ``:keyword value`` pairs (keywords come last)."""
    positional: list[Any] = []
    keywords: list[tuple[Kw, Any]] = []
    items = list(items)
    i = 0
    while i < len(items):
        x = items[i]
        if isinstance(x, Kw):
            if i + 1 >= len(items) or isinstance(items[i + 1], Kw):
                raise err(f":{x.name} needs a value", x.pos)
            keywords.append((x, items[i + 1]))
            i += 2
            continue
        if keywords:
            raise err(f"positional {show(x)} after keyword arguments", x.pos)
        positional.append(x)
        i += 1
    return positional, keywords


def pick_keywords(
    pairs: list[tuple[Kw, Any]], allowed: tuple[str, ...], what: str
) -> dict[str, Any]:
    """The ``:keyword value`` pairs by name, each one of ``allowed`` and given once."""
    out: dict[str, Any] = {}
    for kw, v in pairs:
        if kw.name not in allowed:
            listed = ", ".join(":" + a for a in allowed) if allowed else "none"
            raise err(
                f"{what} has no option :{kw.name}{suggest(kw.name, allowed)}; its options: {listed}",
                kw.pos,
            )
        if kw.name in out:
            raise err(f":{kw.name} is given twice", kw.pos)
        out[kw.name] = v
    return out
