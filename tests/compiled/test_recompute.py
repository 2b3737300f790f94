"""A repeat whose iterations recompute their activations, under the compiled lowering.

The program's repeated block has dropout inside it and a wide hidden layer, the
only tensors of their size (batch x seq x hidden), so that one keeps for the
backward pass shows. One module-scoped set of runs serves every test:

- ``full``: ``sexpgpu run --lowering compiled --choose stack=recompute``, 4 steps,
  checkpoints at 2 and 4;
- ``part``: the step-2 checkpoint of ``full`` resumed with nothing asked (the
  recorded lowering and kernels are taken), to step 4;
- ``probe``: ``recompute_probe.py`` in a subprocess: the same steps through
  the session's ``lower`` on the eager lowering (looped, unrolled) and compiled
  (recompute), with the sizes of what autograd keeps for the backward pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.compiled.conftest import run_named
from tests.e2e.helpers import events, experiments

BATCH, SEQ, DIM, HIDDEN, LAYERS = 8, 8, 16, 48, 3

PROGRAM = f"""
(defmodel blk (dim hidden)
  (layer up (linear dim hidden))
  (layer down (linear hidden dim))
  (forward (x) (+ x (dropout (down (gelu (up x))) 0.2))))
(defmodel net (vocab dim hidden layers)
  (layer embed (embedding vocab dim))
  (layer blocks (repeat layers (blk dim hidden)))
  (layer head (linear dim vocab))
  (forward (ids) (-> (embed ids) blocks head)))
(defdata train (sort :vocab 16) :seq {SEQ} :batch {BATCH})
(defrun rc
  :model (net 16 {DIM} {HIDDEN} {LAYERS})
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adamw :lr 0.01)
  :steps 4
  :checkpoint-every 2
  :seed 3)
"""

SITE = "stack:model.blocks"
TWO, FOUR = "step-00000002", "step-00000004"
PROBE = Path(__file__).with_name("recompute_probe.py")

# the module compiles a program once cold (tens of seconds on 2 cores)
# The module's runs are made by its first test's setup: several processes each
# allowed 600 s (tests/compiled/conftest.run_named); the suite's 300 s per test would
# cut them off on a loaded machine (it did: a setup timed out at 300 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _run(folder: Path, env: dict[str, str], name: str, *args: str):
    return run_named(folder, env, "rc.sx", name, *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, compiled_env: dict[str, str]):
    folder = tmp_path_factory.mktemp("recompute")
    (folder / "rc.sx").write_text(PROGRAM)
    done = {
        "full": _run(
            folder, compiled_env, "full", "--lowering", "compiled", "--choose", "stack=recompute"
        )
    }
    assert done["full"].returncode == 0, done["full"].stderr[-3000:]
    shutil.copytree(folder / "full" / TWO, folder / "part" / TWO)
    done["part"] = _run(folder, compiled_env, "part", "--resume", "latest")
    assert done["part"].returncode == 0, done["part"].stderr[-3000:]
    # the probe lowers the same program with the same pins: torch's caches serve it
    probe = subprocess.run(
        [sys.executable, str(PROBE), "rc.sx", "4"],
        cwd=folder,
        env=compiled_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    return folder, done, json.loads(probe.stdout.strip().splitlines()[-1])


def _tensors(step_dir: Path) -> dict:
    return {
        **load_file(str(step_dir / "params.safetensors")),
        **load_file(str(step_dir / "states.safetensors")),
    }


def _losses(metrics: Path) -> dict[int, float]:
    (run_dir,) = experiments(metrics)
    return {e["step"]: e["value"] for e in events(run_dir) if e.get("name") == "loss"}


def test_a_recomputing_repeat_trains_as_the_eager_lowering_within_float_tolerance(runs):
    folder, _, probe = runs
    ours = probe["compiled/recompute"]
    assert ours["choices"][SITE] == "recompute"
    assert ours["losses"][-1] < ours["losses"][0]  # it learns
    for way in ("torch/looped", "torch/unrolled"):
        assert probe[way]["choices"][SITE] == way.split("/")[1]
        assert ours["losses"] == pytest.approx(probe[way]["losses"], rel=1e-5), way
    # the run the user starts with --choose trains the same
    run = _losses(folder / "metrics-full")
    assert sorted(run) == [1, 2, 3, 4]
    assert [run[s] for s in sorted(run)] == pytest.approx(probe["torch/looped"]["losses"], rel=1e-5)


def test_the_body_s_activations_are_not_kept_but_computed_again(runs):
    # Only the body's hidden layer (its matmul, its gelu) has batch x seq x hidden
    # elements. The eager loop keeps them for the backward pass; a recomputing
    # repeat keeps only what enters each iteration, and its backward computes the
    # hidden layer again (the gradients, hence the losses above, still agree).
    _, _, probe = runs
    hidden = BATCH * SEQ * HIDDEN

    def kept(way: str) -> int:
        return sum(1 for n in probe[way]["saved"] if n == hidden)

    assert kept("torch/looped") >= LAYERS
    assert kept("compiled/recompute") == 0
    assert sum(probe["compiled/recompute"]["saved"]) < sum(probe["torch/looped"]["saved"])


def test_the_graphs_compile_whole(runs):
    _, done, probe = runs
    assert probe["graph_breaks"] == 0
    # two graphs: the loss with its backward, and the update (none stayed eager)
    assert probe["graphs_compiled"] == 2
    assert all("graph breaks" not in result.stderr for result in done.values())


def test_a_resume_is_bit_exact_and_takes_the_recorded_kernel(runs):
    folder, _, _ = runs
    resumed, uninterrupted = _tensors(folder / "part" / FOUR), _tensors(folder / "full" / FOUR)
    assert resumed.keys() == uninterrupted.keys()
    assert all(resumed[k].tobytes() == uninterrupted[k].tobytes() for k in resumed)
    losses = _losses(folder / "metrics-full")
    assert _losses(folder / "metrics-part") == {s: losses[s] for s in (3, 4)}
    choices = json.loads((folder / "part" / FOUR / "experiment.json").read_text())["choices"]
    assert choices[SITE] == "recompute" and choices["lowering"] == "compiled"
