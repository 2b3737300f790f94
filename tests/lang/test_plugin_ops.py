"""A third-party op through the ``sexpgpu_ops`` hook, as a plugin author and a user
meet it: ``sexpgpu`` in a subprocess, with a throwaway plugin on PYTHONPATH."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.foundation.pluginkit import make_plugin, run_sexpgpu

SQUAREPLUS = '''
"""squareplus: (x + sqrt(x^2 + b)) / 2, a smooth relu, as a third-party op."""

from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, Keyword, OpSpec, same_float


def _torch():
    import torch

    def build(attrs):
        b = attrs["b"]
        return lambda x: (x + torch.sqrt(x * x + b)) / 2

    return build


SPEC = OpSpec(
    "squareplus",
    "(x + sqrt(x^2 + b)) / 2, a smooth relu",
    same_float,
    (Arg("x"),),
    (Keyword("b", "number", 4.0),),
)


@hookimpl
def sexpgpu_ops():
    return [OpInfo("squareplus", SPEC, {"torch": _torch}, SPEC.doc)]
'''

# an op whose only implementation is for a lowering that is not installed
ELSEWHERE = """
from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float

SPEC = OpSpec("halfplus", "x / 2 + 1", same_float, (Arg("x"),))


@hookimpl
def sexpgpu_ops():
    return [OpInfo("halfplus", SPEC, {"tpu": lambda: None}, SPEC.doc)]
"""

PROGRAM = """
(defknob steps 6)
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.5))
  (param head [dim vocab] :init (normal 0.5))
  (forward (tokens) (matmul (OP (take embed tokens) ARGS) head)))
(defdata train (arithmetic :digits 2) :seq 10 :batch 4)
(defrun sq
  :model (net 16 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.05)
  :steps steps
  :checkpoint-every 2
  :seed 3)
"""


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    make_plugin(
        root,
        "sexpgpu-squareplus",
        {"sexpgpu_squareplus": SQUAREPLUS},
        {"sqp": "sexpgpu_squareplus"},
    )
    make_plugin(
        root,
        "sexpgpu-elsewhere",
        {"sexpgpu_elsewhere": ELSEWHERE},
        {"elsewhere": "sexpgpu_elsewhere"},
    )
    return root


def _program(tmp_path: Path, op: str = "squareplus", args: str = ":b 2.0") -> str:
    (tmp_path / "sq.sx").write_text(PROGRAM.replace("OP", op).replace("ARGS", args))
    return "sq.sx"


def _run(tmp_path: Path, plugins: Path, *args: str, **env: str):
    return run_sexpgpu(
        ["run", "sq.sx", "--metrics-dir", "m", *args], cwd=tmp_path, pythonpath=[plugins], **env
    )


def _tensors(step: Path) -> dict[str, bytes]:
    return {n: (step / n).read_bytes() for n in ("params.safetensors", "states.safetensors")}


def test_a_plugin_op_trains_checkpoints_and_resumes_to_the_bit(tmp_path, plugins):
    _program(tmp_path)
    whole = _run(tmp_path, plugins, "--checkpoint-dir", "whole")
    assert whole.returncode == 0, whole.stderr
    stopped = _run(tmp_path, plugins, "--checkpoint-dir", "part", "--steps", "2")
    assert stopped.returncode == 0, stopped.stderr
    resumed = _run(tmp_path, plugins, "--checkpoint-dir", "part", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr
    last = "step-00000006"
    assert _tensors(tmp_path / "whole" / last) == _tensors(tmp_path / "part" / last)
    # the op did something: with another :b the run ends elsewhere
    _program(tmp_path, args=":b 9.0")
    other = _run(tmp_path, plugins, "--checkpoint-dir", "other")
    assert other.returncode == 0, other.stderr
    assert _tensors(tmp_path / "other" / last) != _tensors(tmp_path / "whole" / last)


def test_check_names_the_disabled_plugin_that_supplies_an_op(tmp_path, plugins):
    _program(tmp_path)
    ok = run_sexpgpu(["check", "sq.sx"], cwd=tmp_path, pythonpath=[plugins])
    assert ok.returncode == 0, ok.stderr
    gone = run_sexpgpu(
        ["check", "sq.sx"], cwd=tmp_path, pythonpath=[plugins], SEXPGPU_DISABLE_PLUGINS="sqp"
    )
    assert gone.returncode == 1
    line = gone.stderr.strip().splitlines()[-1]
    assert line.startswith("sq.sx:6:30: unknown op 'squareplus'"), line
    assert "disabled by SEXPGPU_DISABLE_PLUGINS: sqp" in line
    assert "Traceback" not in gone.stderr


def test_an_unavailable_plugin_is_named_with_its_reason(tmp_path):
    root = make_plugin(
        tmp_path / "plugins",
        "sexpgpu-squareplus",
        {"sexpgpu_squareplus": SQUAREPLUS + UNAVAILABLE},
        {"sqp": "sexpgpu_squareplus"},
    )
    _program(tmp_path)
    r = run_sexpgpu(["check", "sq.sx"], cwd=tmp_path, pythonpath=[root])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "sq.sx:6:30: the op 'squareplus' needs the plugin 'sqp', which is unavailable:"
        " needs the squareplus accelerator"
    )


UNAVAILABLE = """

@hookimpl
def sexpgpu_unavailable():
    return "needs the squareplus accelerator"
"""


def test_a_plugin_op_without_an_implementation_fails_at_lowering(tmp_path, plugins):
    _program(tmp_path, op="halfplus", args="")
    checked = run_sexpgpu(["check", "sq.sx"], cwd=tmp_path, pythonpath=[plugins])
    assert checked.returncode == 0, checked.stderr  # the spec is enough to check a program
    r = _run(tmp_path, plugins, "--checkpoint-dir", "ck")
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "sexpgpu run: sq.sx:6:29: E-OP-001: the op 'halfplus' from the plugin 'elsewhere' has no"
    )
    assert "implementation for the lowering 'torch' (it has: tpu)" in line
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_a_plugin_op_keyword_is_checked_from_its_spec(tmp_path, plugins):
    _program(tmp_path, args=":b true")
    r = run_sexpgpu(["check", "sq.sx"], cwd=tmp_path, pythonpath=[plugins])
    assert r.returncode == 1
    assert r.stderr.strip().endswith("sq.sx:6:64: :b must be a number, got true")
    _program(tmp_path, args=":c 1")
    r = run_sexpgpu(["check", "sq.sx"], cwd=tmp_path, pythonpath=[plugins])
    assert "squareplus has no option :c; its options: :b" in r.stderr
