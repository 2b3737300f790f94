"""How deep a program may nest: one documented number (docs/language.md, "Limits")
that the reader and the compiler both take, and a positioned error beyond it."""

from __future__ import annotations

from lang_helpers import sexpgpu

from sexpgpu.lang.reader import MAX_NESTING


def _program(levels: int) -> str:
    # each (+ ...) is one level; with defrun, sum, cast and (model ...) the file nests levels + 4
    loss = "(+ " * levels + "(sum (cast (model inputs) f32))" + " 1)" * levels
    return f"""(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (forward (tokens) (take embed tokens)))
(defdata d (arithmetic :digits 1) :seq 8 :batch 2)
(defrun r :model (net 16 8) :data d
  :loss {loss}
  :optimizer (sgd :lr 0.1) :steps 1)
"""


def test_a_program_nested_to_the_limit_checks_and_runs(tmp_path) -> None:
    assert MAX_NESTING >= 10_000
    (tmp_path / "deep.sx").write_text(_program(MAX_NESTING - 4))
    r = sexpgpu("check", "deep.sx", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-500:]
    r = sexpgpu("run", "deep.sx", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-500:]
    assert "run finished" in r.stderr


def test_a_program_nested_beyond_the_limit_is_refused_at_its_place(tmp_path) -> None:
    (tmp_path / "deep.sx").write_text(_program(MAX_NESTING))
    r = sexpgpu("check", "deep.sx", cwd=tmp_path)
    assert r.returncode == 1
    # the opening bracket one past the limit (defrun is level 1): the MAX_NESTING-th (+ on line 6
    col = len("  :loss ") + 3 * (MAX_NESTING - 1) + 1
    assert r.stderr.strip() == (
        f"deep.sx:6:{col}: brackets nested more than {MAX_NESTING} deep"
        " (the most a program may nest)"
    )
