"""The reader: `.sx` text to S-expression nodes that remember where they were written.

Syntax: ``( )`` lists, ``[ ]`` vectors, ``:keywords``, symbols, integers, floats
(``1e-3``), strings with ``\\n \\t \\" \\\\`` escapes, ``true``/``false`` and ``;``
comments. Every node carries a :class:`sexpgpu.errors.Pos`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import Pos, SourceError

__all__ = ["MAX_NESTING", "Sym", "Kw", "Atom", "SList", "SVec", "Node", "read", "show"]

MAX_NESTING = 10_000
"""The deepest nesting of brackets a `.sx` file may have (docs/language.md, "Limits").
The reader refuses more where it starts, and the compiler, which recurses over the
forms, is given the stack to take this much (:func:`sexpgpu.lang.compile_file`)."""


@dataclass(frozen=True)
class Sym:
    """A symbol such as ``matmul`` or ``model``."""

    name: str
    pos: Pos


@dataclass(frozen=True)
class Kw:
    """A keyword such as ``:steps`` (``name`` is without the colon)."""

    name: str
    pos: Pos


@dataclass(frozen=True)
class Atom:
    """A literal: an int, a float, a string or a bool."""

    value: Any
    pos: Pos


@dataclass(frozen=True)
class SList:
    """A parenthesised list ``( ... )``."""

    items: tuple[Node, ...]
    pos: Pos


@dataclass(frozen=True)
class SVec:
    """A bracketed vector ``[ ... ]`` (shapes, binding lists)."""

    items: tuple[Node, ...]
    pos: Pos


Node = Sym | Kw | Atom | SList | SVec

_DELIMS = set('()[];"') | set(" \t\r\n\f\v")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "r": "\r", "0": "\0"}
_CLOSER = {"(": ")", "[": "]"}


def read(text: str, file: str) -> list[Node]:
    """Read every top-level form of ``text``; ``file`` names it in positions.

    Raises :class:`SourceError` at the offending place: an unclosed bracket is
    reported at its opening, a stray closer where it stands.
    """
    forms: list[Node] = []
    # an explicit stack, so deep nesting cannot exhaust Python's recursion limit
    stack: list[tuple[str, Pos, list[Node]]] = []
    i, line, col, n = 0, 1, 1, len(text)

    def here() -> Pos:
        return Pos(file, line, col)

    def emit(node: Node) -> None:
        (stack[-1][2] if stack else forms).append(node)

    while i < n:
        c = text[i]
        if c == "\n":
            i, line, col = i + 1, line + 1, 1
            continue
        if c in " \t\r\f\v,":
            i, col = i + 1, col + 1
            continue
        if c == ";":
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c in "([":
            if len(stack) >= MAX_NESTING:
                raise SourceError(
                    f"brackets nested more than {MAX_NESTING} deep (the most a program may nest)",
                    pos=here(),
                )
            stack.append((c, here(), []))
            i, col = i + 1, col + 1
            continue
        if c in ")]":
            if not stack:
                raise SourceError(f"unexpected '{c}' with nothing open", pos=here())
            opener, pos, items = stack[-1]
            if _CLOSER[opener] != c:
                raise SourceError(
                    f"'{c}' does not close the '{opener}' opened at {pos.line}:{pos.col}"
                    f" (expected '{_CLOSER[opener]}')",
                    pos=here(),
                )
            stack.pop()
            emit(SList(tuple(items), pos) if opener == "(" else SVec(tuple(items), pos))
            i, col = i + 1, col + 1
            continue
        if c == '"':
            atom, i, line, col = _string(text, i, line, col, file)
            emit(atom)
            continue
        start_i, start = i, here()
        while i < n and text[i] not in _DELIMS:
            i += 1
        col += i - start_i
        emit(_token(text[start_i:i], start))
    if stack:
        opener, pos, _ = stack[-1]
        raise SourceError(f"'{opener}' is never closed", pos=pos)
    return forms


def _string(text: str, i: int, line: int, col: int, file: str) -> tuple[Atom, int, int, int]:
    """The string whose opening quote is at ``text[i]``; returns it and where
    reading goes on (index, line, column)."""
    start = Pos(file, line, col)
    n = len(text)
    i, col = i + 1, col + 1
    chars: list[str] = []
    while True:
        if i >= n:
            raise SourceError("unterminated string", pos=start)
        c = text[i]
        if c == '"':
            return Atom("".join(chars), start), i + 1, line, col + 1
        if c == "\\":
            if i + 1 >= n:
                raise SourceError("unterminated string", pos=start)
            e = text[i + 1]
            if e not in _ESCAPES:
                raise SourceError(
                    f"unknown escape '\\{e}' in a string (use \\n \\t \\\" \\\\)",
                    pos=Pos(file, line, col),
                )
            chars.append(_ESCAPES[e])
            i, col = i + 2, col + 2
            continue
        chars.append(c)
        if c == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1


def _token(tok: str, pos: Pos) -> Node:
    if tok == "true":
        return Atom(True, pos)
    if tok == "false":
        return Atom(False, pos)
    if tok.startswith(":"):
        if len(tok) == 1:
            raise SourceError("a keyword needs a name after ':'", pos=pos)
        return Kw(tok[1:], pos)
    if tok[0].isdigit() or (
        len(tok) > 1 and tok[0] in "+-." and (tok[1].isdigit() or tok[1] == ".")
    ):
        try:
            return Atom(int(tok, 10), pos)
        except ValueError:
            pass
        try:
            return Atom(float(tok), pos)
        except ValueError:
            raise SourceError(f"malformed number '{tok}'", pos=pos) from None
    return Sym(tok, pos)


def deepest(forms: list[Node]) -> Pos | None:
    """Where the deepest node of ``forms`` is written (walked without recursion)."""
    best: tuple[int, Pos | None] = (-1, None)
    todo: list[tuple[Node, int]] = [(f, 0) for f in forms]
    while todo:
        node, depth = todo.pop()
        if depth > best[0]:
            best = (depth, node.pos)
        if isinstance(node, (SList, SVec)):
            todo.extend((x, depth + 1) for x in node.items)
    return best[1]


def show(node: Node | Any) -> str:
    """The node as it would be written back (for messages)."""
    if isinstance(node, Sym):
        return node.name
    if isinstance(node, Kw):
        return ":" + node.name
    if isinstance(node, Atom):
        v = node.value
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            # Written back with escapes, so a message quoting it stays on one line.
            escaped = v.replace("\\", "\\\\").replace('"', '\\"')
            escaped = escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
            return '"' + escaped + '"'
        return repr(v)
    if isinstance(node, SList):
        return "(" + " ".join(show(x) for x in node.items) + ")"
    if isinstance(node, SVec):
        return "[" + " ".join(show(x) for x in node.items) + "]"
    return str(node)
