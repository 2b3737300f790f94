"""An error inside a `<core>` layer names the user's call site first, at every
nesting level, on one line (docs/language.md, "Syntax"): `sexpgpu check` as a user runs it
(its entry point, in this process: tests/inprocess.py)."""

from __future__ import annotations

from lang_helpers import in_process

TAIL = """(defdata d (arithmetic :digits 1) :seq 8 :batch 2)
(defrun r :model (net 16 8) :data d :loss (sum (model inputs)) :optimizer (sgd :lr 0.1)
  :steps 1)
"""


def _check(tmp_path, model: str, files: dict[str, str] | None = None) -> str:
    (tmp_path / "my.sx").write_text(model + TAIL)
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    r = in_process("check", "my.sx", cwd=tmp_path)
    assert r.returncode == 1, r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    return r.stderr.strip()


def test_a_shape_error_in_a_core_layer_names_the_call_then_the_prelude(tmp_path) -> None:
    line = _check(
        tmp_path,
        "(defmodel net (vocab dim)\n"
        "  (param embed [vocab dim] :init (normal 0.02))\n"
        "  (layer proj (linear 128 64))\n"
        "  (forward (tokens)\n"
        "    (proj (take embed tokens))))\n",
    )
    assert line.startswith("my.sx:5:5: in model.proj (linear 128 64): <core>:"), line
    assert ": matmul: cannot multiply f32[2, 8, 8] and f32[128, 64]" in line


def test_every_level_of_the_prelude_is_named_down_to_the_op(tmp_path) -> None:
    line = _check(
        tmp_path,
        "(defmodel net (vocab dim)\n"
        "  (param embed [vocab dim] :init (normal 0.02))\n"
        "  (layer blk (transformer-block dim 3))\n"
        "  (forward (tokens) (blk (take embed tokens))))\n",
    )
    head, rest = line.split(": in model.blk (transformer-block 8 3): <core>:", 1)
    assert head == "my.sx:4:21"
    assert ": in model.blk.attn (causal-attention 8 3): <core>:" in rest
    assert rest.endswith("attention: :heads 3 does not divide the dim of f32[2, 8, 8]")


def test_an_error_declaring_a_core_layers_parameters_names_where_it_is_made(tmp_path) -> None:
    line = _check(
        tmp_path,
        "(defmodel net (vocab dim)\n"
        "  (param embed [vocab dim] :init (normal 0.02))\n"
        "  (layer proj (linear (- dim 9) dim))\n"
        "  (forward (tokens) (proj (take embed tokens))))\n",
    )
    assert line.startswith("my.sx:3:15: in model.proj (linear -1 8): <core>:"), line
    assert line.endswith("a dimension must be an integer >= 1, got -1")


def test_an_error_in_the_users_own_files_points_there_alone(tmp_path) -> None:
    lib = (
        "(deflayer mine (dim)\n"
        "  (layer inner (linear dim 5))\n"
        "  (param w [dim dim] :init (normal 0.02))\n"
        "  (forward (x) (inner (matmul x w))))\n"
    )
    line = _check(
        tmp_path,
        '(include "lib.sx")\n'
        "(defmodel net (vocab dim)\n"
        "  (param embed [vocab dim] :init (normal 0.02))\n"
        "  (layer m (mine dim))\n"
        "  (forward (tokens) (matmul (m (take embed tokens)) (take embed tokens))))\n",
        {"lib.sx": lib},
    )
    # the core layer's error is framed at its call in lib.sx; the wrong shape of the
    # result is the main file's own error, pointed at there
    assert line.startswith("my.sx:5:21: matmul: cannot multiply f32[2, 8, 5]"), line
    lib_error = lib.replace("(linear dim 5)", "(linear 7 5)")
    line = _check(
        tmp_path,
        '(include "lib.sx")\n'
        "(defmodel net (vocab dim)\n"
        "  (param embed [vocab dim] :init (normal 0.02))\n"
        "  (layer m (mine dim))\n"
        "  (forward (tokens) (m (take embed tokens))))\n",
        {"lib.sx": lib_error},
    )
    # framed at the call in lib.sx, the user's file where it can be fixed, and no further
    assert line.startswith("lib.sx:4:16: in model.m.inner (linear 7 5): <core>:"), line
    assert "my.sx" not in line
