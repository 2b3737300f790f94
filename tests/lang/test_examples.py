"""The shipped examples compile, and my-run.sx has the spec's exact shape."""

from __future__ import annotations

import math

import pytest
from lang_helpers import EXAMPLES, compile_file


@pytest.mark.parametrize("name", ["my-run.sx", "tiny-lm.sx", "cnn.sx"])
def test_example_compiles(name):
    program = compile_file(str(EXAMPLES / name))
    assert program.sources[0].name == "<core>" and program.sources[0].path is None
    assert program.sources[1].name == name
    for stage in program.stages:
        assert stage.loss.output_types()[0].shape == ()
    for ev in program.evals:
        assert all(t.shape == () for t in ev.graph.output_types())


def test_my_run_matches_the_spec():
    p = compile_file(str(EXAMPLES / "my-run.sx"))
    assert [(x.path, x.type.shape, x.type.dtype, x.trainable) for x in p.params] == [
        ("model.embed", (32, 8), "f32", True),
        ("model.head", (8, 32), "f32", True),
        ("model.noise", (32,), "f32", False),
    ]
    noise = p.param("model.noise")
    assert noise.init.kind == "uniform" and noise.init.args == (-1.0, 1.0) and noise.load is None
    assert p.run.name == "my-run" and p.run.seed == 7 and p.run.checkpoint_every == 2
    assert (
        p.run.counters == ("tokens",) and p.run.precision == "f32" and p.run.guard_finite is False
    )
    assert {k.name: (k.value, k.source) for k in p.knobs} == {
        "lr": (0.5, "default"),
        "steps": (4, "default"),
        "guard": (False, "default"),
    }
    assert p.steps == 4 and p.stages[0].optimizer.name == "adam"
    assert p.stages[0].optimizer.options["lr"] == 0.5
    assert p.stages[0].optimizer.schedule.kind == "constant"
    assert p.stages[0].data.source == "arithmetic"


def test_my_run_steps_and_guard_are_knobs():
    p = compile_file(str(EXAMPLES / "my-run.sx"), sets={"lr": "0.25", "guard": "true"}, steps=6)
    assert p.steps == 6 and p.run.guard_finite is True
    assert p.stages[0].optimizer.options["lr"] == 0.25
    assert {k.name: k.source for k in p.knobs} == {
        "lr": "command line",
        "steps": "command line",
        "guard": "command line",
    }


def test_tiny_lm_is_small_and_stacked():
    p = compile_file(str(EXAMPLES / "tiny-lm.sx"))
    total = sum(math.prod(x.type.shape) for x in p.params)
    assert total < 200_000
    assert [s.name for s in p.sites] == ["attention:model.blocks.attn", "stack:model.blocks"]
    assert len((EXAMPLES / "tiny-lm.sx").read_text().splitlines()) <= 40
    assert p.steps == 200
    wide = compile_file(str(EXAMPLES / "tiny-lm.sx"), variant="wide")
    assert wide.variant == "wide" and wide.param("model.embed.table").type.shape == (16, 64)
    assert p.param("model.embed.table").type.shape == (16, 32)


def test_cnn_uses_convolutions_and_pooling():
    p = compile_file(str(EXAMPLES / "cnn.sx"))
    ops = {n.op for n in p.stages[0].loss.nodes}
    assert {"conv2d", "max_pool2d", "reshape", "cross_entropy"} <= ops
    assert p.evals[0].metrics == ("loss", "accuracy")
