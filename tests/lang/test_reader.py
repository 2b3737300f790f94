"""The reader: every kind of token, positions, and positioned syntax errors."""

from __future__ import annotations

import pytest

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang.reader import Atom, Kw, SList, SVec, Sym, read, show


def test_atoms_and_their_values():
    forms = read('foo :bar 12 -3 1.5 1e-3 -2.5e2 "s" true false +x - ->', "f.sx")
    assert [type(f).__name__ for f in forms] == [
        "Sym",
        "Kw",
        "Atom",
        "Atom",
        "Atom",
        "Atom",
        "Atom",
        "Atom",
        "Atom",
        "Atom",
        "Sym",
        "Sym",
        "Sym",
    ]
    values = [f.value for f in forms if isinstance(f, Atom)]
    assert values == [12, -3, 1.5, 0.001, -250.0, "s", True, False]
    assert type(values[0]) is int and type(values[3]) is float
    assert forms[1] == Kw("bar", Pos("f.sx", 1, 5))
    assert [f.name for f in forms if isinstance(f, Sym)] == ["foo", "+x", "-", "->"]


def test_lists_vectors_and_positions():
    text = "; a comment\n(defknob lr 0.5) ; trailing\n  [a\n   (b 1)]"
    forms = read(text, "my-run.sx")
    assert len(forms) == 2
    first, second = forms
    assert isinstance(first, SList) and first.pos == Pos("my-run.sx", 2, 1)
    assert first.items[1] == Sym("lr", Pos("my-run.sx", 2, 10))
    assert first.items[2] == Atom(0.5, Pos("my-run.sx", 2, 13))
    assert isinstance(second, SVec) and second.pos == Pos("my-run.sx", 3, 3)
    inner = second.items[1]
    assert isinstance(inner, SList) and inner.pos == Pos("my-run.sx", 4, 4)
    assert inner.items[1].pos == Pos("my-run.sx", 4, 7)


def test_string_escapes_and_positions_after_multiline_strings():
    forms = read('"a\\n\\t\\"q\\"\\\\" "two\nlines" x', "f.sx")
    assert forms[0].value == 'a\n\t"q"\\'
    assert forms[1].value == "two\nlines"
    assert forms[2].pos == Pos("f.sx", 2, 8)


def test_show_round_trips():
    text = '(defrun r :steps 4 :tags [a "b"] :on true)'
    assert show(read(text, "f.sx")[0]) == text


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("(a (b c)\n(d)", "1:1", "'(' is never closed"),
        ("(a\n  [b c)", "2:7", "')' does not close the '[' opened at 2:3 (expected ']')"),
        ("(a))", "1:4", "unexpected ')' with nothing open"),
        ('(a "abc', "1:4", "unterminated string"),
        ('"a\\qb"', "1:3", "unknown escape '\\q'"),
        ("(x 1.2.3)", "1:4", "malformed number '1.2.3'"),
        ("(x 12abc)", "1:4", "malformed number '12abc'"),
        ("(x : y)", "1:4", "a keyword needs a name after ':'"),
    ],
)
def test_syntax_errors_are_positioned(text, where, message):
    with pytest.raises(SourceError) as info:
        read(text, "my-run.sx")
    assert str(info.value).startswith(f"my-run.sx:{where}: ")
    assert message in str(info.value)


def test_unclosed_bracket_is_reported_at_its_opening_deep_in_a_file():
    text = "(a)\n(b)\n(c\n  (d e)\n  (f g)\n"
    with pytest.raises(SourceError) as info:
        read(text, "x.sx")
    assert info.value.pos == Pos("x.sx", 3, 1)


def test_deep_nesting_does_not_exhaust_the_stack():
    from sexpgpu.lang.reader import MAX_NESTING

    depth = MAX_NESTING
    forms = read("(" * depth + ")" * depth, "f.sx")
    assert isinstance(forms[0], SList)


def test_nesting_beyond_the_limit_is_refused_where_it_starts():
    from sexpgpu.lang.reader import MAX_NESTING

    text = "(a\n " + "[" * MAX_NESTING + "]" * MAX_NESTING + ")"
    with pytest.raises(SourceError) as info:
        read(text, "f.sx")
    assert info.value.pos == Pos("f.sx", 2, MAX_NESTING + 1)
    assert f"nested more than {MAX_NESTING} deep" in str(info.value)
