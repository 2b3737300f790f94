"""Knobs and variants: typed --set values, --steps, variants, and each knob's source."""

from __future__ import annotations

import pytest
from lang_helpers import RUN, compile_text

from sexpgpu.errors import SourceError, UsageError
from sexpgpu.lang.ir import Knob

TEXT = """
(defknob lr 0.5 "learning rate")
(defknob steps 4 "steps")
(defknob dim 8)
(defknob guard false)
(defknob tag "x")
(defknob prec f32)
(defvariant big "a bigger model" :dim 16 :lr 1)
(defvariant half :prec bf16 :guard true)
(defmodel net (vocab dim)
  (param embed [vocab dim])
  (param head [dim vocab])
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 8 :batch 2)
(defrun t :model (net 16 dim) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr lr) :steps steps :guard-finite guard :precision prec)
"""


def knobs(**kw) -> dict[str, Knob]:
    return {k.name: k for k in compile_text(TEXT, "k.sx", **kw).knobs}


def test_defaults():
    k = knobs()
    assert k["lr"] == Knob("lr", 0.5, 0.5, "default", "learning rate")
    assert (k["steps"].value, k["guard"].value, k["tag"].value, k["prec"].value) == (
        4,
        False,
        "x",
        "f32",
    )


def test_set_is_typed_by_the_default():
    k = knobs(sets={"lr": "1", "steps": "7", "guard": "true", "tag": "y z", "prec": "bf16"})
    assert k["lr"].value == 1.0 and type(k["lr"].value) is float
    assert k["steps"].value == 7 and k["guard"].value is True and k["tag"].value == "y z"
    assert {n.source for n in k.values() if n.name != "dim"} == {"command line"}
    assert k["dim"].source == "default"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("lr", "fast", "--set lr=fast: knob 'lr' takes a number (its default is 0.5)"),
        ("lr", "nan", "--set lr=nan: knob 'lr' takes a number"),
        ("steps", "1.5", "--set steps=1.5: knob 'steps' takes an integer (its default is 4)"),
        (
            "guard",
            "maybe",
            "--set guard=maybe: knob 'guard' takes true or false (its default is false)",
        ),
        ("prec", "(x)", "--set prec=(x): knob 'prec' takes a name"),
        (
            "lrr",
            "1",
            "--set lrr: unknown knob (did you mean 'lr'?); knobs: dim, guard, lr, prec, steps, tag",
        ),
    ],
)
def test_bad_set(name, value, message):
    with pytest.raises(UsageError) as info:
        knobs(sets={name: value})
    assert str(info.value).startswith(message) and info.value.exit_code == 2


def test_variant_then_command_line():
    p = compile_text(TEXT, "k.sx", variant="big", sets={"lr": "0.1"})
    k = {n.name: n for n in p.knobs}
    assert p.variant == "big"
    assert (k["dim"].value, k["dim"].source) == (16, "variant")
    assert (k["lr"].value, k["lr"].source) == (0.1, "command line")
    assert p.param("model.embed").type.shape == (16, 16)
    half = compile_text(TEXT, "k.sx", variant="half")
    assert half.run.precision == "bf16" and half.run.guard_finite is True


def test_unknown_variant_lists_them():
    with pytest.raises(
        UsageError, match=r"unknown variant 'bigg' \(did you mean 'big'\?\); variants: big, half"
    ):
        knobs(variant="bigg")


def test_steps_sets_the_steps_knob():
    p = compile_text(TEXT, "k.sx", steps=9)
    assert p.steps == 9 and p.knobs[1] == Knob("steps", 9, 4, "command line", "steps")
    with pytest.raises(UsageError, match="--steps must be a positive integer"):
        compile_text(TEXT, "k.sx", steps=0)


def test_steps_without_a_steps_knob():
    text = TEXT.replace('(defknob steps 4 "steps")', "").replace(":steps steps", ":steps 3")
    with pytest.raises(UsageError, match="--steps sets the knob 'steps', and this file has none"):
        compile_text(text, "k.sx", steps=5)


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("(defvariant v :dimm 3)", "k.sx:17:15: unknown knob 'dimm' (did you mean 'dim'?)"),
        ("(defvariant v :dim 1.5)", "k.sx:17:20: knob 'dim' takes an integer, got 1.5"),
        ("(defvariant v :guard 1)", "k.sx:17:22: knob 'guard' takes true or false, got 1"),
        ("(defvariant v dim 3)", "k.sx:17:15: a variant sets knobs as :name value pairs, got dim"),
        ("(defvariant big :dim 3)", "k.sx:17:13: variant 'big' is already defined at k.sx:8:13"),
    ],
)
def test_bad_variants_are_reported_even_when_not_chosen(variant, message):
    with pytest.raises(SourceError) as info:
        compile_text(TEXT + variant, "k.sx")
    assert str(info.value).startswith(message)


def test_knob_used_where_a_number_is_needed_must_be_one():
    with pytest.raises(SourceError, match="a dimension must be an integer >= 1, got 'x'"):
        compile_text(TEXT.replace("(net 16 dim)", "(net 16 tag)"), "k.sx")


def test_knobs_are_visible_in_layers_and_expressions():
    text = "(defknob scale 2.0)" + TEXT.replace(
        "(matmul (take embed tokens) head)", "(* scale (matmul (take embed tokens) head))"
    )
    p = compile_text(text, "k.sx", sets={"scale": "3"})
    consts = [n.attrs["value"] for n in p.stages[0].loss.nodes if n.op == "const"]
    assert consts == [3.0]


def test_run_options_compile_with_knob_values():
    p = compile_text(TEXT + "", "k.sx", sets={"lr": "0.125"})
    assert p.stages[0].optimizer.options["lr"] == 0.125
    assert RUN  # the shared run text stays importable
