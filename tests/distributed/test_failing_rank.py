"""An op that fails on one rank: that rank says its own error, not a lost group."""

from __future__ import annotations

import subprocess

import pytest

from tests.foundation.pluginkit import make_plugin, sexpgpu_command, user_env

from .kit import DEVICE

BOOM_PLUGIN = '''
"""boom: the identity, until its third call with gradients on rank 1."""

import os

from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float

CALLS = [0]


def _torch():
    import torch

    def build(attrs):
        def boom(x):
            if x.device.type != "meta" and torch.is_grad_enabled():
                CALLS[0] += 1
                if os.environ.get("RANK") == "1" and CALLS[0] == 3:
                    raise RuntimeError("boom on rank 1")
            return x

        return boom

    return build


SPEC = OpSpec("boom", "x, failing on rank 1", same_float, (Arg("x"),))


@hookimpl
def sexpgpu_ops():
    return [OpInfo("boom", SPEC, {"torch": _torch}, SPEC.doc)]
'''

PROGRAM = """
(defmodel net (vocab seq dim)
  (layer embed (embedding vocab dim))
  (layer head (linear dim vocab))
  (forward (ids) (head (boom (embed ids)))))

(defdata train (sort :vocab 8) :seq 8 :batch 4)

(defrun failing
  :model (net 8 8 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1)
  :steps 6
  :seed 1)
"""


@pytest.mark.slow
def test_an_op_failing_on_one_rank_is_that_ranks_own_line(tmp_path):
    plugin = make_plugin(tmp_path / "plugin", "sexpgpu-boom", {"sexpgpu_boom": BOOM_PLUGIN},
                         {"boom": "sexpgpu_boom"})  # fmt: skip
    (tmp_path / "failing.sx").write_text(PROGRAM)
    result = subprocess.run(
        [*sexpgpu_command(), "run", "failing.sx", "--devices", "2", "--device", DEVICE],
        cwd=tmp_path,
        env=user_env([plugin]),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("sexpgpu run:")]
    assert "Traceback" not in result.stderr, result.stderr
    # the failing rank names its error, its step and the traceback it kept; it lost no
    # group (the other did, and says so)
    (own,) = [line for line in lines if "boom" in line]
    assert own.startswith("sexpgpu run: rank 1: step 3: RuntimeError: boom on rank 1 "), own
    kept = own.split("(traceback in ", 1)[1].rstrip(")")
    assert "boom on rank 1" in (tmp_path / kept).read_text()
    assert "lost the group" not in own
