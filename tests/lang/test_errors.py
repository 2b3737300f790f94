"""Bad programs: each mistake is one positioned line, with a hint where one helps."""

from __future__ import annotations

import pytest
from lang_helpers import BASE, RUN, compile_text

from sexpgpu.errors import SexpError, SourceError


def _error(text: str) -> str:
    with pytest.raises(SourceError) as info:
        compile_text(text, "my-run.sx")
    return str(info.value)


def run(extra: str = "", **replace: str) -> str:
    body, r = BASE, RUN
    for old, new in replace.items():
        old = old.replace("_", " ")
        if old in body:
            body = body.replace(old, new, 1)
        else:
            r = r.replace(old, new, 1)
    return body + f"(defrun t {r} {extra})"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            run(":stepz 3"),
            "my-run.sx:10:42: defrun has no option :stepz (did you mean 'steps'?); its options: :model,",
        ),
        (
            run(adam="adamm"),
            "my-run.sx:10:15: unknown optimizer 'adamm' (did you mean 'adam'?); optimizers: adam, adamw, sgd",
        ),
        (
            run(**{"(adam :lr lr)": "(adam :lr lr :weight-decai 1)"}),
            "my-run.sx:10:27: optimizer 'adam' has no option :weight-decai (did you mean ':weight-decay'?); its options: :beta1,",
        ),
        (run(**{"(adam :lr lr)": "(adam)"}), "my-run.sx:10:14: optimizer 'adam' needs :lr"),
        (
            run(**{":data train": ":data trian"}),
            "my-run.sx:9:35: unknown data 'trian' (did you mean 'train'?); defdata: train",
        ),
        (run(**{"(net 16 8)": "(net 16)"}), "my-run.sx:9:18: net needs dim (net vocab dim)"),
        (
            run(**{"(net 16 8)": "(net 16 8 3)"}),
            "my-run.sx:9:18: net takes 2 arguments (vocab dim), got 3",
        ),
        (
            run(**{"(net 16 8)": "(nett 16 8)"}),
            "my-run.sx:9:19: unknown layer 'nett' (did you mean 'net'?); layers:",
        ),
        (
            run(**{"(model inputs)": "(model inptus)"}),
            "my-run.sx:9:79: unknown name 'inptus' (did you mean 'inputs'?)",
        ),
        (
            run(**{"(model inputs)": "(modl inputs)"}),
            "my-run.sx:9:73: unknown op 'modl' (did you mean 'model'?)",
        ),
        (
            run(**{"(model inputs)": "(model inputs targets)"}),
            "my-run.sx:9:72: model (net) takes 1 input (tokens), got 2",
        ),
        (
            run(**{"(cross-entropy (model inputs) targets)": "(model inputs)"}),
            "my-run.sx:9:57: the loss must be a scalar, got f32[2, 8, 16]; reduce it, e.g. (mean ...)",
        ),
        (
            run(**{":loss (cross-entropy (model inputs) targets)": ":loss 3"}),
            "my-run.sx:9:57: the loss must be a tensor expression, got 3",
        ),
        (
            run(**{"(arithmetic :digits 3)": "(arithmetic :digit 3)"}),
            "my-run.sx:8:28: data source 'arithmetic' has no option :digit (did you mean ':digits'?); its options: :digits, :split",
        ),
        (
            run(**{"(arithmetic :digits 3)": "(arithmetik :digits 3)"}),
            "my-run.sx:8:17: unknown data source 'arithmetik' (did you mean 'arithmetic'?)",
        ),
        (
            run(**{"(arithmetic :digits 3)": "(arithmetic :digits 1.5)"}),
            "my-run.sx:8:37: :digits must be an integer, got 1.5",
        ),
        (
            run(**{"(normal 0.02)": "(normal)"}),
            "my-run.sx:5:34: normal takes 1 argument: (normal std)",
        ),
        (
            run(**{"(normal 0.02)": "(gauss 1)"}),
            "my-run.sx:5:34: unknown initializer 'gauss'; initializers: kaiming, normal, ones, uniform, xavier, zeros",
        ),
        (
            run(**{"(normal 0.02)": "(uniform 1 -1)"}),
            "my-run.sx:5:34: uniform needs low < high, got 1.0 and -1.0",
        ),
        (
            run(**{"[vocab dim]": "[vocab dimm]"}),
            "my-run.sx:5:23: unknown name 'dimm' (did you mean 'dim'?)",
        ),
        (
            run(**{"[vocab dim]": "[vocab 0]"}),
            "my-run.sx:5:23: a dimension must be an integer >= 1, got 0",
        ),
        (
            run(**{"[vocab dim]": "(vocab dim)"}),
            "my-run.sx:5:16: a shape is a vector such as [vocab dim], got (vocab dim)",
        ),
        (
            run(**{"[vocab dim]": "[vocab dim] :dtype f16"}),
            "my-run.sx:5:55: a parameter's dtype is f32 or bf16, got f16",
        ),
        (
            run(**{"[vocab dim]": "[vocab dim] :frozen 1"}),
            "my-run.sx:5:56: :frozen must be true or false, got 1",
        ),
        (
            run(**{"[vocab dim]": "[vocab dim] :trainable true"}),
            "my-run.sx:5:55: param has no option :trainable",
        ),
        (run(":precision f16"), "my-run.sx:10:53: :precision is f32 or bf16, got f16"),
        (
            run(":counters (tokens recs)"),
            "my-run.sx:10:60: unknown counter 'recs' (did you mean 'records'?); counters: generated, records, tokens",
        ),
        (
            run(":checkpoint-every 0"),
            "my-run.sx:10:60: :checkpoint-every must be an integer >= 1, got 0",
        ),
        (run(":guard-finite yes"), "my-run.sx:10:57: unknown name 'yes'"),
        (
            run(":evals ((eval p :every 1 :metrics (los)))"),
            "my-run.sx:10:78: unknown metric los (did you mean 'loss'?): a metric is one of accuracy,",
        ),
        (run(":evals ((eval p :metrics (loss)))"), "my-run.sx:10:50: eval p needs :every N"),
        (
            run(**{":steps steps": ":steps 0"}),
            "my-run.sx:10:35: :steps must be an integer >= 1, got 0",
        ),
        (
            run(**{":steps steps": ":steps 1.5"}),
            "my-run.sx:10:35: :steps must be an integer >= 1, got 1.5",
        ),
        (run(**{":steps steps": ""}), "my-run.sx:9:1: defrun needs :steps"),
        (
            run(":stages ((stage a :steps 1))"),
            "my-run.sx:10:29: with :stages, each stage has its own :steps; remove the run's :steps",
        ),
        (
            run(**{"(adam :lr lr)": "(adam :lr lr :schedule (cosin :warmup 3))"}),
            "my-run.sx:10:38: unknown schedule 'cosin' (did you mean 'cosine'?)",
        ),
        (
            run(**{"(adam :lr lr)": "(adam :lr lr :clip -1)"}),
            "my-run.sx:10:33: :clip is a positive global norm (or false), got -1",
        ),
        (BASE, "my-run.sx:1:1: no (defrun ...) in this program"),
        (
            run() + "(defrun u)",
            "my-run.sx:10:42: a program has one defrun; the first is at my-run.sx:9:1",
        ),
        (
            "(defmodl x)",
            "my-run.sx:1:2: unknown top-level form 'defmodl' (did you mean 'defmodel'?)",
        ),
        ("42", "my-run.sx:1:1: expected a top-level form such as (defrun ...), got 42"),
        ("(defknob lr)", "my-run.sx:1:1: defknob takes a name, a default and an optional doc"),
        (
            "(defknob lr 1) (defknob lr 2)",
            "my-run.sx:1:25: knob 'lr' is already defined at my-run.sx:1:10",
        ),
        (
            "(deflayer a (x) (forward (y) y)) (deflayer a (x) (forward (y) y))",
            "my-run.sx:1:44: layer 'a' is already defined at my-run.sx:1:11",
        ),
        ("(deflayer a (x))", "my-run.sx:1:1: deflayer a has no (forward (x) ...)"),
        (
            "(deflayer a (x) (parm w [x]) (forward (y) y))",
            "my-run.sx:1:18: unknown item 'parm' in deflayer a (did you mean 'param'?)",
        ),
        (
            "(deflayer a (x) (param w [x]) (param w [x]) (forward (y) y))",
            "my-run.sx:1:38: 'w' is already declared at my-run.sx:1:24",
        ),
        (
            run(
                **{
                    "(forward (tokens) (matmul (take embed tokens) head))": "(layer l (nope 3)) (forward (tokens) (l tokens))"
                }
            ),
            "my-run.sx:7:13: unknown layer 'nope'",
        ),
        (
            "(deflayer a () (layer b (b)) (forward (x) x)) (deflayer b () (layer a (a)) (forward (x) x))"
            + run(**{"(net 16 8)": "(a)"}),
            "layer 'a' contains itself (a -> b -> a)",
        ),
        (
            run(
                **{
                    "(forward (tokens) (matmul (take embed tokens) head))": "(forward (tokens) (embed tokens))"
                }
            ),
            "my-run.sx:7:22: 'embed' is a parameter, not an op or layer",
        ),
        (
            run(
                **{
                    "(forward (tokens) (matmul (take embed tokens) head))": "(forward (tokens) (let [a] a))"
                }
            ),
            "my-run.sx:7:28: let bindings come in name value pairs",
        ),
        (
            run(
                **{
                    "(forward (tokens) (matmul (take embed tokens) head))": "(forward (tokens) (-> tokens 3))"
                }
            ),
            "my-run.sx:7:32: a -> step is a name or (name args...), got 3",
        ),
        (
            run(
                **{
                    "(forward (tokens) (matmul (take embed tokens) head))": "(forward (tokens) (reshape tokens [-1 -1]))"
                }
            ),
            "my-run.sx:7:37: reshape's shape [-1, -1] may hold one -1",
        ),
        (
            run(':with-loaded (model (net 1 1) :file "t.safetensors")'),
            "a second root needs its own name, not 'model'",
        ),
        (run(":with-loaded (t (net 1 1))"), "with-loaded needs :file"),
        (
            run(':with-loaded (t (net 1 1) :file "t.safetensors" :names "x")'),
            ":names maps a parameter to its tensor with {path}",
        ),
    ],
)
def test_positioned_errors(text, expected):
    got = _error(text)
    file, line, col, message = got.split(":", 3)
    assert file == "my-run.sx" and int(line) >= 1 and int(col) >= 1
    if expected.startswith("my-run.sx:"):
        # the line is checked exactly; the column is checked by the tests below
        _, want_line, _, want = expected.split(":", 3)
        assert line == want_line
        assert message.startswith(want), got
    else:
        assert expected in got


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (run(**{"[vocab dim]": "[vocab dim] :frozen 1"}), "5:36"),
        (run(":precision f16"), "10:52"),
        (run(**{"(model inputs)": "(modl inputs)"}), "9:63"),
        (run(**{"(model inputs)": "(model inptus)"}), "9:69"),
        (run(**{"(arithmetic :digits 3)": "(arithmetic :digit 3)"}), "8:28"),
    ],
)
def test_error_columns(text, where):
    assert _error(text).startswith(f"my-run.sx:{where}: ")


def test_errors_are_one_line_and_always_positioned():
    for text in [run(adam="adamm"), run(":stepz 3"), "(a", '(include "x.sx" "y")']:
        message = _error(text)
        assert "\n" not in message and message.startswith("my-run.sx:")


def test_a_missing_main_file(tmp_path):
    from lang_helpers import compile_file

    with pytest.raises(SourceError, match=r"cannot read .*nope\.sx: No such file"):
        compile_file(str(tmp_path / "nope.sx"))


def test_every_user_error_is_a_sexp_error():
    # an unlisted kind of mistake still comes out as a SexpError, never a Python error
    for text in [
        "(defrun)",
        "(defrun t :model)",
        "(defrun t :model 3)",
        "(defdata)",
        "(defvariant v :a)",
        "(include)",
        "(defmodel m (1) (forward (x) x))",
    ]:
        with pytest.raises(SexpError):
            compile_text(text, "t.sx")


def test_a_quoted_string_with_a_newline_keeps_the_error_on_one_line():
    # Found by the fuzz test: a string at top level, quoted back in the message.
    with pytest.raises(SourceError) as caught:
        compile_text('(defknob dim 2)\n" \n "', "fuzz.sx")
    assert "\n" not in str(caught.value)
    assert str(caught.value).endswith('got " \\n "')
