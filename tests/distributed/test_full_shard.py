"""Fully sharded training (``:shard full``: FSDP2) on two ranks, through the real launcher.

Each rank keeps a slice of every parameter, gradient and optimizer state of
``full.sx`` (two repeated blocks, a unit each; tables of 17 rows, which split
unevenly). The slices' gradients are reduce-scattered, which adds in another order
than DDP's buckets, so a fully sharded run's bytes are its own: the reference here
is an uninterrupted two-rank ``full`` run, which every stopped, killed or resumed
one must end with. A checkpoint holds whole tensors, gathered from the slices.
"""

from __future__ import annotations

import json
import os
import random
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from sexpgpu.errors import PluginError
from sexpgpu.extension import OptimizerUpdate, with_defaults
from tests.catalogs import compile_file, lower
from tests.e2e.helpers import (
    assert_every_checkpoint_complete,
    assert_same_tensors,
    events,
    experiments,
    step_dirs,
    wait_for_step,
)

from .kit import (
    HERE,
    SIGNALS,
    interrupted_lines,
    last_pass_and_evaluate,
    launch,
    project,
    start,
    worker_pid,
)

FULL = "full.sx"
TWO = ("--devices", "2")  # the program says :shard full
STEPS = 120
"""Long enough for a signal at step 3-30 to land mid-run (a fully sharded step is slow)."""


def _last(root):
    return root / "ckpt" / f"step-{STEPS:08d}"


def _run_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("sexpgpu run:")]


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory):
    """An uninterrupted two-rank ``full`` run of STEPS steps: its folder."""
    root = project(tmp_path_factory.mktemp("full-reference"), FULL)
    result = launch(root, *TWO, steps=STEPS, program=FULL)
    assert result.returncode == 0, result.stderr
    return root


def test_units_are_the_repeats_iterations_and_the_rest_is_the_root():
    from sexpgpu_torch.placement.fully_sharded import plan_units

    program = compile_file(str(HERE / FULL))
    trainable = [d.path for d in program.params if d.trainable]
    units, root = plan_units(program, trainable)
    assert [sorted({p.split(".")[2] for p in unit}) for unit in units] == [["0"], ["1"]]
    assert all(p.startswith("model.blocks.") for unit in units for p in unit)
    assert sorted(root) == sorted(p for p in trainable if not p.startswith("model.blocks."))
    assert sorted([*root, *(p for unit in units for p in unit)]) == sorted(trainable)


def test_a_rank_slice_is_torch_chunk_rows_and_empty_past_the_last():
    from sexpgpu_torch.placement.fully_sharded import rows_of

    table = torch.arange(17 * 3, dtype=torch.float32).reshape(17, 3)
    assert torch.equal(torch.cat([rows_of(table, r, 2) for r in range(2)]), table)
    assert [rows_of(table, r, 2).shape[0] for r in range(2)] == [9, 8]
    one = torch.ones(1, 4)
    assert rows_of(one, 1, 2).shape == (0, 4)
    # FSDP2 shards no scalar: one is cut as a tensor of one element
    assert rows_of(torch.tensor(2.0), 0, 2).tolist() == [2.0]
    assert rows_of(torch.tensor(2.0), 1, 2).shape == (0,)


def test_an_update_that_is_not_elementwise_is_refused_with_one_line():
    program = compile_file(str(HERE / FULL))
    trainer = lower(program)
    update, options = trainer.updates[0]
    assert update.elementwise  # adamw computes each element from its own

    class WholeTensors:  # a third-party update that says nothing
        pass

    # as the lowering takes an update from its optimizer's factory
    trainer.updates[0] = (with_defaults(WholeTensors(), OptimizerUpdate), options)
    trainer.shard = "full"
    group = SimpleNamespace(rank=0, size=2)
    with pytest.raises(PluginError) as caught:
        trainer.use_group(group)
    assert str(caught.value) == (
        "the optimizer 'adamw' cannot update slices of parameters (shard full): its "
        "update does not say elementwise = True; shard none or optimizer"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_full_shards_stop_on_a_signal_and_resume_to_the_bytes(full_reference, tmp_path, name):
    root = project(tmp_path, FULL)
    at = random.Random(f"full {name}").randint(3, 30)
    proc = start(root, *TWO, "--resume", "latest", steps=STEPS, program=FULL)
    wait_for_step(root / "m", at, proc)
    os.kill(worker_pid(proc, 1) if name == "SIGHUP" else proc.pid, SIGNALS[name])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + SIGNALS[name], err
    (line,) = interrupted_lines(err)
    n = int(line.rsplit(" ", 1)[1])
    assert step_dirs(root / "ckpt")[-1] == f"step-{n:08d}"
    assert_every_checkpoint_complete(root / "ckpt")
    # whole tensors, as the program declares them, gathered from both ranks' slices
    stopped = root / "ckpt" / f"step-{n:08d}"
    params = load_file(str(stopped / "params.safetensors"))
    states = load_file(str(stopped / "states.safetensors"))
    declared = {d.path: tuple(d.type.shape) for d in compile_file(str(HERE / FULL)).params}
    assert {path: array.shape for path, array in params.items()} == declared
    assert declared["model.embed.table"] == (17, 24)
    assert set(states) == {f"{p}/{s}" for p in params for s in ("m", "v")}
    for key, array in states.items():
        assert array.shape == params[key.split("/")[0]].shape, key
        assert np.isfinite(array).all()
    experiment = json.loads((stopped / "experiment.json").read_text())
    assert (experiment["choices"]["shard"], experiment["devices"]) == ("full", 2)
    again = launch(root, *TWO, "--resume", "latest", steps=STEPS, program=FULL)
    assert again.returncode == 0, again.stderr
    assert_same_tensors(_last(root), _last(full_reference))


@pytest.mark.slow
def test_a_killed_worker_of_full_shards_restarts_to_the_bytes(full_reference, tmp_path):
    root = project(tmp_path, FULL)
    proc = start(root, *TWO, "--resume", "latest", "--max-restarts", "1", steps=STEPS, program=FULL)
    wait_for_step(root / "m", 30, proc)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert_same_tensors(_last(root), _last(full_reference))


@pytest.mark.slow
def test_an_eval_pass_on_full_shards_gives_one_process_numbers(full_reference, tmp_path):
    # three batches on two ranks, shared out (0 and 2, then 1), each rank reading the
    # parameters gathered whole at its first batch
    last, again = last_pass_and_evaluate(
        full_reference, tmp_path / "copy", "probe/accuracy", steps=STEPS
    )
    assert again == [last]


@pytest.mark.slow
def test_full_shards_are_pinned_counted_and_can_be_left(tmp_path):
    root = project(tmp_path, FULL)
    first = launch(root, *TWO, steps=6, program=FULL)
    assert first.returncode == 0, first.stderr
    refused = launch(root, *TWO, "--shard", "none", "--resume", "latest", steps=8, program=FULL)
    assert refused.returncode == 1, refused.stderr
    assert _run_lines(refused.stderr) == [
        "sexpgpu run: E-CHOICE-001: the recorded choice 'full' for shard cannot be "
        "taken with --shard none (use --choices fresh to choose again)"
    ]
    three = launch(root, "--devices", "3", "--resume", "latest", steps=8, program=FULL)
    assert three.returncode == 1, three.stderr
    assert _run_lines(three.stderr)[0].startswith("sexpgpu run: E-DP-002: "), three.stderr
    # the whole tensors of a full checkpoint resume replicated, and back
    for shard, steps in (("none", 8), ("full", 10)):
        moved = launch(
            root,
            *TWO,
            "--shard",
            shard,
            "--choices",
            "fresh",
            "--resume",
            "latest",
            steps=steps,
            program=FULL,
        )
        assert moved.returncode == 0, moved.stderr
    (run_dir,) = experiments(root / "m")
    texts = [e.get("text", "") for e in events(run_dir)]
    assert any("choice shard full -> none" in text for text in texts), texts
    assert any("choice shard none -> full" in text for text in texts), texts


@pytest.mark.slow
def test_the_finite_guard_stops_full_shards_with_one_line(tmp_path):
    root = project(tmp_path, FULL)
    bad = launch(root, *TWO, "--set", "guard=true", "--set", "lr=1e39", steps=4, program=FULL)
    assert bad.returncode == 1, bad.stderr
    (line,) = _run_lines(bad.stderr)
    assert line.startswith("sexpgpu run: step 1: the proposed ")
    assert line.endswith("values that are not finite; nothing was committed")
    assert not (root / "ckpt").exists() or not step_dirs(root / "ckpt")
