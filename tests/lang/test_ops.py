"""Each op's shape and dtype rule, through the language and through ops.infer."""

from __future__ import annotations

import pytest
from lang_helpers import compile_text, model_output

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops import infer

P = Pos("t.sx", 1, 1)


def T(*shape, dtype="f32"):
    return TensorType(tuple(shape), dtype)


@pytest.mark.parametrize(
    ("params", "expr", "expected"),
    [
        ("(param w [4 3])", "(matmul x w)", T(4, 3)),
        ("(param w [4])", "(matmul x w)", T(4)),
        ("(param w [2 4 5])", "(matmul x w)", T(2, 4, 5)),
        ("(param b [4])", "(+ x b)", T(4, 4)),
        ("(param b [3 1 4])", "(* x b)", T(3, 4, 4)),
        ("", "(- x)", T(4, 4)),
        ("", "(- x 1 2)", T(4, 4)),
        ("", "(/ x 2)", T(4, 4)),
        ("", "(pow x 2)", T(4, 4)),
        ("(param b [4] :dtype bf16)", "(maximum (cast x bf16) b)", T(4, 4, dtype="bf16")),
        ("(param b [4] :dtype bf16)", "(minimum x b)", T(4, 4)),
        ("", "(relu (gelu (silu (tanh (sigmoid (exp (log (sqrt (rsqrt (abs x))))))))))", T(4, 4)),
        ("", "(reshape x [2 -1])", T(2, 8)),
        ("", "(reshape x [16])", T(16)),
        ("", "(flatten (reshape x [2 2 4]))", T(2, 8)),
        ("", "(transpose (reshape x [2 8]))", T(8, 2)),
        ("", "(transpose (reshape x [1 2 8]) 0 -1)", T(8, 2, 1)),
        ("", "(concat x x :axis 0)", T(8, 4)),
        ("", "(concat x x)", T(4, 8)),
        ("", "(slice x :axis 1 :start 1 :stop 3)", T(4, 2)),
        ("", "(slice x :start -2)", T(4, 2)),
        ("", "(sum x)", T()),
        ("", "(mean x :axis -1)", T(4)),
        ("", "(max x :axes [0 1] :keepdim true)", T(1, 1)),
        ("", "(softmax x)", T(4, 4)),
        ("", "(log-softmax x :axis 0)", T(4, 4)),
        ("(param w [4 4])", "(layer-norm x (sum w :axis 0) (mean w :axis 1) :eps 1e-6)", T(4, 4)),
        ("(param w [4])", "(rms-norm x w)", T(4, 4)),
        ("(param w [4 4])", "(let [h (reshape x [1 4 4])] (attention h h h :heads 2))", T(1, 4, 4)),
        ("(param w [6 1 3 3])", "(conv2d (reshape x [1 1 4 4]) w :padding 1)", T(1, 6, 4, 4)),
        (
            "(param w [6 1 3 3]) (param b [6])",
            "(conv2d (reshape x [1 1 4 4]) w b :stride 2)",
            T(1, 6, 1, 1),
        ),
        ("", "(max-pool2d (reshape x [1 1 4 4]) :kernel 2)", T(1, 1, 2, 2)),
        ("", "(avg-pool2d (reshape x [1 1 4 4]) :kernel 3 :stride 1)", T(1, 1, 2, 2)),
        ("", "(dropout x 0.1)", T(4, 4)),
        ("", "(dropout x :p 0.5)", T(4, 4)),
        ("", "(mse x x)", T()),
        ("", "(cast x bf16)", T(4, 4, dtype="bf16")),
        ("", "(-> x (* 2) relu (sum :axis 0))", T(4)),
        ("", "(if (> 1 0) x (neg x))", T(4, 4)),  # numbers compare before training
        ("(param b [4])", "(< x b)", T(4, 4, dtype="bool")),
        ("", "(!= x 0.5)", T(4, 4, dtype="bool")),
        ("", "(where (>= x 0) x 0.0)", T(4, 4)),
        ("(param b [4] :dtype bf16)", "(where (== x 1) b (cast x bf16))", T(4, 4, dtype="bf16")),
        ("", "(argmax x)", T(4, dtype="i64")),
        ("", "(argmax x :axis 0 :keepdim true)", T(1, 4, dtype="i64")),
        ("", "(gather x (argmax x))", T(4)),
        ("", "(gather x (argmax x :keepdim true) :axis 1)", T(4, 1)),
        ("", "(stop-gradient x)", T(4, 4)),
        ("", "(group-mean x :size 2)", T(4, 4)),
        ("", "(/ (- x (group-mean x :size 4)) (+ (group-std x :size 4) 1e-6))", T(4, 4)),
    ],
)
def test_op_shape_rules(params, expr, expected):
    assert model_output(params, expr) == expected


@pytest.mark.parametrize(
    ("params", "expr", "expected"),
    [
        ("(param t [16 8])", "(take t x)", T(4, 6, 8)),
        ("(param t [16 8])", "(cross-entropy (take t x) x)", T()),
        ("(param t [16 8])", "(accuracy (take t x) x)", T()),
        ("(param t [16 8])", "(+ x 1)", T(4, 6, dtype="i64")),
    ],
)
def test_ops_on_token_inputs(params, expr, expected):
    assert model_output(params, expr, data="(arithmetic)") == expected


def test_const_nodes_follow_the_other_operand():
    text = """
(defmodel m () (param w [4]) (forward (x) (* (+ x 2) 0.5)))
(defdata d (vectors) :batch 4)
(defrun t :model (m) :data d :loss (mean (model inputs)) :optimizer (sgd :lr 0.1) :steps 1)
"""
    nodes = compile_text(text, "t.sx").stages[0].loss.nodes
    consts = [(n.attrs["value"], n.type) for n in nodes if n.op == "const"]
    assert consts == [(2.0, T()), (0.5, T())]
    assert type(consts[0][0]) is float


def test_compile_time_arithmetic_folds():
    assert model_output("(param w [(* 2 2) (+ 1 (/ 6 2))])", "(matmul x w)") == T(4, 4)
    assert model_output("", "(reshape x [(size x 0) (* 2 2)])") == T(4, 4)
    assert model_output("", "(reshape x (shape x))") == T(4, 4)


@pytest.mark.parametrize(
    ("params", "expr", "message"),
    [
        (
            "(param w [3 5])",
            "(matmul x w)",
            "matmul: cannot multiply f32[4, 4] and f32[3, 5]: inner sizes 4 and 3 differ",
        ),
        ("(param b [3])", "(+ x b)", "add: shapes f32[4, 4] and f32[3] do not broadcast"),
        (
            "",
            "(reshape x [3 5])",
            "reshape: cannot reshape f32[4, 4] (16 values) to [3, 5] (15 values)",
        ),
        ("", "(reshape x [3 -1])", "cannot fit f32[4, 4] (16 values) into [3, -1]"),
        ("", "(transpose x 0 2)", "transpose: an axis 2 is out of range for f32[4, 4]"),
        (
            "",
            "(concat x (sum x :axis 0) :axis 0)",
            "concat: f32[4, 4] and f32[4] differ outside axis 0",
        ),
        ("", "(slice x :start 3 :stop 2)", "slice: range 3..2 is not within axis 1"),
        ("", "(sum x :axis 2)", "sum: :axis 2 is out of range"),
        ("", "(take x x)", "take: indices must be i64, got f32[4, 4]"),
        (
            "(param w [3])",
            "(rms-norm x w)",
            "rms_norm: weight f32[3] does not fit f32[4, 4] (expected [4])",
        ),
        (
            "",
            "(attention x x x :heads 2)",
            "attention: q must be [batch, time, dim], got f32[4, 4]",
        ),
        (
            "",
            "(let [h (reshape x [1 4 4])] (attention h h h :heads 3))",
            "attention: :heads 3 does not divide",
        ),
        ("", "(attention x x x)", "attention needs :heads"),
        (
            "(param w [6 2 3 3])",
            "(conv2d (reshape x [1 1 4 4]) w)",
            "conv2d: the weight f32[6, 2, 3, 3] takes 2 channels but the input f32[1, 1, 4, 4] has 1",
        ),
        ("(param w [6 1 5 5])", "(conv2d (reshape x [1 1 4 4]) w)", "larger than the padded input"),
        (
            "",
            "(max-pool2d x :kernel 2)",
            "max_pool2d: the input must be [batch, channels, height, width], got f32[4, 4]",
        ),
        ("", "(dropout x 1.5)", "dropout's p must be in [0, 1), got 1.5"),
        (
            "",
            "(cross-entropy x x)",
            "cross_entropy: targets must be i64 class indices, got f32[4, 4]",
        ),
        (
            "",
            "(mse x (sum x :axis 0))",
            "mse: prediction f32[4, 4] and target f32[4] must have the same shape",
        ),
        ("", "(cast x f64)", "unknown dtype 'f64'"),
        ("", "(softmax x :axis 1.5)", ":axis must be an integer"),
        ("", "(matmul x)", "matmul takes 2 arguments, got 1"),
        ("", "(relu x :p 1)", "relu has no option :p"),
        ("", "(mean x :axis 0 :axes [0])", "mean takes :axis or :axes, not both"),
        ("(param b [3])", "(< x b)", "lt: shapes f32[4, 4] and f32[3] do not broadcast"),
        ("", "(where x x x)", "where: the condition must be a bool tensor"),
        ("", "(argmax x :axis 2)", "argmax: :axis 2 is out of range"),
        ("", "(gather x x)", "gather: indices must be i64, got f32[4, 4]"),
        (
            "",
            "(gather x (argmax (reshape x [2 8])))",
            "gather: indices i64[2] must have the shape of f32[4, 4] without axis 1 ([4])",
        ),
        ("", "(group-mean x :size 3)", "group_mean: the first axis of f32[4, 4] must hold whole"),
        ("", "(group-std x :size 1)", "group_std: :size must be an integer >= 2, got 1"),
        ("", "(group-mean x)", "group-mean needs :size, e.g. :size 4"),
        ("", "(group-mean (argmax x) :size 2)", "must be a floating tensor"),
    ],
)
def test_op_errors_name_the_op_and_shapes(params, expr, message):
    with pytest.raises(SourceError) as info:
        model_output(params, expr)
    assert message in str(info.value)
    assert str(info.value).startswith("t.sx:")


def test_shape_error_points_at_the_op():
    text = """(defmodel m ()
  (param w [3 5])
  (forward (x)
    (relu (matmul x w))))
(defdata d (vectors) :batch 4)
(defrun t :model (m) :data d :loss (mean (model inputs)) :optimizer (sgd :lr 0.1) :steps 1)
"""
    with pytest.raises(SourceError) as info:
        compile_text(text, "my-run.sx")
    assert info.value.pos == Pos("my-run.sx", 4, 11)


def test_cross_entropy_targets_must_fit_the_logits():
    with pytest.raises(
        SourceError, match=r"logits f32\[4, 6, 16\] and targets i64\[4, 5\] do not fit"
    ):
        model_output(
            "(param t [16 16])", "(cross-entropy (take t x) (slice x :stop 5))", data="(arithmetic)"
        )


@pytest.mark.parametrize(
    ("op", "args", "attrs", "expected"),
    [
        ("add", [T(2, 1, 3), T(4, 1)], {}, T(2, 4, 3)),
        ("add", [T(3, dtype="bf16"), T(3, dtype="bf16")], {}, T(3, dtype="bf16")),
        ("mul", [T(3, dtype="bf16"), T(3)], {}, T(3)),
        ("div", [T(3, dtype="i64"), T(3, dtype="i64")], {}, T(3)),
        ("add", [T(3, dtype="i64"), T(3, dtype="i64")], {}, T(3, dtype="i64")),
        ("matmul", [T(5), T(5)], {}, T()),
        ("matmul", [T(7, 1, 2, 3), T(4, 3, 6)], {}, T(7, 4, 2, 6)),
        ("sum", [T(2, 3, 4)], {"axes": (0, 2), "keepdim": False}, T(3)),
        ("sum", [T(2, 3, 4)], {"axes": (1,), "keepdim": True}, T(2, 1, 4)),
        ("take", [T(10, 3), T(2, 5, dtype="i64")], {}, T(2, 5, 3)),
        ("attention", [T(2, 5, 8)] * 3, {"heads": 4, "causal": True}, T(2, 5, 8)),
        ("conv2d", [T(2, 3, 9, 9), T(4, 3, 3, 3)], {"stride": 2, "padding": 0}, T(2, 4, 4, 4)),
        ("max_pool2d", [T(1, 2, 7, 7)], {"kernel": 2, "stride": 2}, T(1, 2, 3, 3)),
        ("cross_entropy", [T(2, 5, 7), T(2, 5, dtype="i64")], {}, T()),
        ("accuracy", [T(2, 7), T(2, dtype="i64")], {}, T()),
        ("transpose", [T(2, 3, 4)], {"axes": (0, 2)}, T(4, 3, 2)),
        ("concat", [T(2, 3), T(2, 5)], {"axis": 1}, T(2, 8)),
        ("slice", [T(2, 9)], {"axis": 1, "start": 2, "stop": 5}, T(2, 3)),
        ("layer_norm", [T(2, 6), T(6), T(6)], {"eps": 1e-5}, T(2, 6)),
        ("cast", [T(2)], {"dtype": "bf16"}, T(2, dtype="bf16")),
    ],
)
def test_infer(op, args, attrs, expected):
    assert infer(op, args, attrs, P) == expected


@pytest.mark.parametrize(
    ("op", "args", "attrs", "message"),
    [
        ("sum", [T(2, 3)], {"axes": (1, 0), "keepdim": False}, "sorted and distinct"),
        ("matmul", [T(), T(3)], {}, "both need at least one axis"),
        ("exp", [T(3, dtype="i64")], {}, "must be a floating tensor"),
        (
            "attention",
            [T(2, 5, 8), T(2, 4, 8), T(2, 4, 8)],
            {"heads": 2, "causal": False},
            "must have the same shape",
        ),
        ("add", [T(3, dtype="i64"), T(3, dtype="bool")], {}, None),
    ],
)
def test_infer_errors(op, args, attrs, message):
    if message is None:
        assert infer(op, args, attrs, P) == T(3, dtype="i64")
        return
    with pytest.raises(SourceError, match=message):
        infer(op, args, attrs, P)
