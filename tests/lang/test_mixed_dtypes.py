"""A bf16 tensor next to an f32 one: what `sexpgpu check` accepts, `sexpgpu run` trains.

Every op over several floating tensors computes in their promotion (f32 wins over
bf16, docs/ir.md "Dtypes"); the op-by-op check of the lowering is in
tests/torch/test_torch_ops.py, this is the user's view of the same rule.
"""

from __future__ import annotations

import json

import pytest
from lang_helpers import in_process, sexpgpu

# op -> the forward expression over params a (the first dtype) and the rest (the second)
EXPRS = {
    **{op: f"({op} a b)" for op in ("+", "-", "*", "/", "pow", "maximum", "minimum")},
    "matmul": "(matmul a w)",
    "concat": "(concat a b :axis 0)",
    "layer-norm": "(layer-norm a n c)",
    "rms-norm": "(rms-norm a n)",
    "attention": "(attention a3 b3 b3 :heads 2)",
    "conv2d": "(conv2d img k kb)",
    "mse": "(mse a b)",
}


def _program(first: str, second: str) -> str:
    terms = " ".join(f"(sum (cast {e} f32))" for e in EXPRS.values())

    def p(name: str, shape: str, dtype: str) -> str:
        return f"(param {name} {shape} :dtype {dtype} :init (uniform 0.5 1.5))"

    return f"""
(defmodel net ()
  {p("a", "[3 4]", first)} {p("a3", "[2 3 4]", first)} {p("img", "[1 2 5 5]", first)}
  {p("b", "[3 4]", second)} {p("w", "[4 4]", second)} {p("n", "[4]", second)}
  {p("c", "[4]", second)} {p("b3", "[2 3 4]", second)} {p("k", "[3 2 3 3]", second)}
  {p("kb", "[3]", second)}
  (forward (tokens) (+ {terms})))
(defdata d (arithmetic :digits 1) :seq 8 :batch 2)
(defrun mixed :model (net) :data d :loss (model inputs) :optimizer (adam :lr 0.01)
  :steps 2 :seed 1 :guard-finite true)
"""


@pytest.mark.parametrize("first,second", [("bf16", "f32"), ("f32", "bf16")])
def test_every_op_on_mixed_dtypes_checks_and_trains(tmp_path, first, second) -> None:
    (tmp_path / "mixed.sx").write_text(_program(first, second))
    r = in_process("check", "mixed.sx", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ["model.a", "[3,", "4]", first] in [line.split()[:4] for line in r.stdout.splitlines()]
    r = sexpgpu("run", "mixed.sx", "--checkpoint-dir", "ck", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "same dtype" not in r.stderr
    status = json.loads(next(tmp_path.glob("sexpgpu-runs/*/status.json")).read_text())
    assert status["step"] == 2


def test_a_dtype_torch_cannot_combine_is_refused_at_check_time_with_its_place(tmp_path) -> None:
    (tmp_path / "bad.sx").write_text(
        "(defmodel net (vocab dim)\n"
        "  (param embed [vocab dim] :init (normal 0.02))\n"
        "  (forward (tokens) (take embed (cast tokens f32))))\n"
        "(defdata d (arithmetic :digits 1) :seq 8 :batch 2)\n"
        "(defrun r :model (net 16 4) :data d :loss (sum (model inputs))\n"
        "  :optimizer (sgd :lr 0.1) :steps 1)\n"
    )
    r = in_process("check", "bad.sx", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("bad.sx:3:21: take: "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
