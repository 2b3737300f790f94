"""Property: any text, and any mutation of the examples, either compiles or raises
a positioned SexpError; the compiler never fails with a Python error."""

from __future__ import annotations

from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from lang_helpers import EXAMPLES, compile_text

from sexpgpu.errors import SexpError, SourceError
from sexpgpu.lang.ir import Program
from sexpgpu.lang.reader import read
from tests.properties import budget

TEXTS = {p.name: p.read_text() for p in sorted(EXAMPLES.glob("*.sx"))}
TOKENS = [
    "(",
    ")",
    "[",
    "]",
    " ",
    "\n",
    ":",
    '"',
    ";",
    "-",
    "0",
    "1",
    "-1",
    "2",
    "3",
    "1.5",
    "1e400",
    "-0.0",
    "99999999999999999999",
    "x",
    "dim",
    "model",
    "inputs",
    "targets",
    "true",
    "false",
    "nil",
    "matmul",
    "reshape",
    "repeat",
    "let",
    "->",
    "if",
    "+",
    "*",
    "/",
    ":steps",
    ":lr",
    ":init",
    ":frozen",
    ":axis",
    ":heads",
    ":load",
    '(file "a.safetensors" "t")',
    "[-1]",
    "[0]",
    "(normal 0)",
    "(repeat 3 (linear 2 2))",
    "(layer z (mlp 2 4))",
    "(param q [2 2])",
    "(stage s :steps 2)",
    "(eval e :every 1)",
    "bf16",
    "i64",
]


def _check(text: str, name: str = "fuzz.sx") -> None:
    try:
        program = compile_text(text, name)
    except SexpError as exc:
        message = str(exc)
        assert "\n" not in message and message.strip(), message
        if isinstance(exc, SourceError) and exc.pos is not None:
            assert message.startswith(f"{exc.pos.file}:{exc.pos.line}:{exc.pos.col}: ")
        return
    assert isinstance(program, Program)
    for stage in program.stages:
        assert stage.loss.output_types()[0].shape == ()


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(TEXTS)))
    text = TEXTS[name]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "insert", "replace", "duplicate", "swap"]))
        i = draw(st.integers(0, len(text)))
        j = min(len(text), i + draw(st.integers(0, 12)))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "insert":
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[i:]
        elif kind == "replace":
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[j:]
        elif kind == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            k = min(len(text), j + draw(st.integers(0, 12)))
            text = text[:i] + text[j:k] + text[i:j] + text[k:]
    return name, text


@st.composite
def token_words(draw):
    """Mutations at the level of words: replace one word of an example with another."""
    name = draw(st.sampled_from(sorted(TEXTS)))
    words = TEXTS[name].split(" ")
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(words) - 1))
        words[i] = draw(st.sampled_from(TOKENS + words))
    return name, " ".join(words)


# Cases per suite run, each property's time budget (tests/properties.py): about 5 s
# of one core on the project's machine.
ANY_HEALTH = {"suppress_health_check": list(HealthCheck)}


@budget(350, **ANY_HEALTH)
@given(mutated())
def test_mutated_examples(case):
    name, text = case
    _check(text, name)


@budget(450, **ANY_HEALTH)
@given(token_words())
def test_word_mutations(case):
    name, text = case
    _check(text, name)


@budget(500, **ANY_HEALTH)
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join))
def test_token_soup(text):
    _check("(defknob dim 2)\n(defknob x 1)\n" + text)


@budget(500)
@given(st.text(max_size=60))
def test_reader_on_any_text(text):
    try:
        read(text, "r.sx")
    except SourceError as exc:
        assert exc.pos is not None and exc.pos.file == "r.sx"
