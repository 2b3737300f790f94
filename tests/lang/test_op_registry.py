"""The op registry is the one list of ops: the docs' tables agree with it, and its
specs drive how a call is parsed."""

from __future__ import annotations

import re

import pytest
from lang_helpers import ROOT, model_output

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops import (
    BUILTINS,
    STRUCTURAL,
    Arg,
    Keyword,
    OpSpec,
    Registry,
    builtin_ops,
    same_float,
)


def _table_names(path, heading: str) -> set[str]:
    """The backquoted names in the first column of the table under ``heading``."""
    text = (ROOT / "docs" / path).read_text()
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])}


def test_the_language_docs_table_lists_exactly_the_registered_ops():
    assert _table_names("language.md", "### Ops\n") == set(BUILTINS.surface_names())


def test_the_ir_docs_table_lists_exactly_the_registered_ops_and_the_structural_ones():
    assert _table_names("ir.md", "## Ops\n") == BUILTINS.names() | set(STRUCTURAL)


def test_every_spec_has_a_doc_line_and_every_node_op_a_rule():
    for spec in BUILTINS.specs():
        assert spec.doc and "\n" not in spec.doc, spec.name
        assert (spec.infer is not None) == spec.node, spec.name
    assert {s.name for s in builtin_ops()} == BUILTINS.names()
    assert {s.site for s in builtin_ops() if s.site} == {"attention", "conv2d"}


def test_a_registry_refuses_a_name_or_surface_twice():
    spec = OpSpec("twice", "x", same_float, (Arg("x"),))
    reg = Registry([spec])
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(spec)
    with pytest.raises(ValueError, match="surface name '\\+' is taken"):
        Registry([*BUILTINS.specs(), OpSpec("plus", "x", same_float, surface=("+",))])
    with pytest.raises(ValueError, match="kind 'float'"):
        Keyword("b", "float")


def test_generic_parsing_comes_from_the_spec():
    # conv2d's optional bias, layer-norm's default :eps and attention's choice site
    # are all read from their specs; a spec's keyword order is the attrs' order
    spec = BUILTINS.surface("conv2d")
    assert spec is not None and spec.arity() == (2, 3)
    assert [k.name for k in spec.keywords] == ["stride", "padding"]
    assert BUILTINS.surface("log-softmax") is BUILTINS.get("log_softmax")
    assert BUILTINS.surface("+") is BUILTINS.get("add")
    t = model_output("", "(log_softmax x)")  # the IR spelling is accepted too
    assert t == TensorType((4, 4), "f32")


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (
            "(max-pool2d (reshape x [1 1 4 4]))",
            "max-pool2d needs :kernel, e.g. (max-pool2d x :kernel 2)",
        ),
        ("(attention x x x :heads 2 :causal 1)", ":causal must be true or false, got 1"),
        ("(layer-norm x x x :eps 0)", ":eps must be a positive number, got 0"),
        ("(conv2d x x :stride 0)", ":stride must be an integer >= 1, got 0"),
        ("(concat x x :axis 5)", "concat: :axis 5 is out of range for f32[4, 4]"),
        ("(conv2d x)", "conv2d takes 2 to 3 arguments, got 1"),
        ("(concat)", "concat takes at least 1 arguments, got 0"),
    ],
)
def test_generic_parsing_errors(expr, message):
    with pytest.raises(SourceError) as info:
        model_output("", expr)
    assert str(info.value).endswith(message)


def test_infer_of_an_unknown_op_names_it():
    from sexpgpu.lang.ops import infer

    with pytest.raises(SourceError, match="squareplus: is not an op"):
        infer("squareplus", [], {}, Pos("t.sx", 1, 1))
