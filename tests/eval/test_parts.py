"""The eval plugin's parts, in process: its hooks, the pass runner, evaluated.json."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from sexpgpu.batches import Batches
from sexpgpu.checkpoint.evaluated import read_evaluated, write_evaluated
from sexpgpu.errors import CheckpointError
from sexpgpu_eval.passes import PassRunner
from tests.catalogs import open_location, project
from tests.e2e.helpers import run_sexpgpu, sexpgpu_env
from tests.foundation.pluginkit import make_plugin


def test_the_hooks_supply_the_runner_and_the_seven_metrics():
    plugins = project()
    (runner,) = plugins.available("sexpgpu_evaluators")
    metrics = {m.name: m for m in plugins.available("sexpgpu_eval_metrics")}
    assert sorted(metrics) == [
        "accuracy",
        "bits-per-char",
        "generated-length",
        "loss",
        "perplexity",
        "reward",
        "top-k-accuracy",
    ]
    assert metrics["perplexity"].finish(math.log(7.0)) == pytest.approx(7.0)
    assert metrics["bits-per-char"].finish(math.log(2.0)) == pytest.approx(1.0)
    assert isinstance(runner.factory(metrics), PassRunner)


class FakePass:
    name, data, batches, metrics = "probe", "held", 3, ("loss", "ppl")


class FakeTrainer:
    def __init__(self):
        self.batches = []

    def evaluate(self, name, batch):
        self.batches.append(batch["x"])
        return {"loss": float(batch["x"]), "ppl": float(batch["x"])}


class Counting:
    def __init__(self):
        self.at = 0

    def next_batch(self):
        self.at += 1
        return {"x": np.array(self.at)}


def counting() -> Batches:
    """A pass's batches: the counting loader's, made into nothing else (no generator)."""
    return Batches(None, Counting(), None, None, 0, lambda: False)  # type: ignore[arg-type]


def test_the_runner_averages_then_finishes_and_stops_before_a_batch():
    from sexpgpu.extension import EvalMetricInfo

    runner = PassRunner({"ppl": EvalMetricInfo("ppl", "loss", lambda mean: mean * 10)})
    opened = []

    def open_data(eval_pass, seed):
        opened.append((eval_pass.data, seed))
        return counting()

    trainer = FakeTrainer()
    numbers = runner.run_pass(
        FakePass(), trainer, seed=7, open_batches=open_data, stopping=lambda: False
    )
    assert numbers == {"loss": 2.0, "ppl": 20.0}
    assert opened == [("held", 8)]  # eval data is its own stream: the run's seed + 1
    calls = iter([False, True])
    trainer = FakeTrainer()
    stopped = runner.run_pass(
        FakePass(), trainer, seed=7, open_batches=open_data, stopping=lambda: next(calls)
    )
    assert stopped is None and len(trainer.batches) == 1


class HalfOfTwo:
    """Rank ``rank`` of two: ``sum`` adds ``other`` (the other rank's values), and
    keeps what this rank sent."""

    def __init__(self, rank, other=None):
        self.rank, self.size, self.other, self.sent = rank, 2, other, None

    def sum(self, values):
        self.sent = list(values)
        return [a + b for a, b in zip(values, self.other or [0.0] * len(values), strict=True)]


def test_two_ranks_share_a_pass_out_and_give_one_process_numbers():
    runner = PassRunner({})
    alone = runner.run_pass(
        FakePass(),
        FakeTrainer(),
        seed=7,
        open_batches=lambda p, s: counting(),
        stopping=lambda: False,
    )
    second, first = FakeTrainer(), FakeTrainer()
    one = HalfOfTwo(1)
    runner.run_pass(
        FakePass(),
        second,
        seed=7,
        open_batches=lambda p, s: counting(),
        stopping=lambda: False,
        group=one,
    )
    numbers = runner.run_pass(
        FakePass(),
        first,
        seed=7,
        open_batches=lambda p, s: counting(),
        stopping=lambda: False,
        group=HalfOfTwo(0, other=one.sent),
    )
    # rank 0 evaluates batches 0 and 2, rank 1 batch 1; the numbers are one process's
    assert [int(x) for x in first.batches] == [1, 3]
    assert [int(x) for x in second.batches] == [2]
    assert numbers == alone


def test_evaluated_json_round_trips_and_a_bad_one_is_refused(tmp_path):
    storage = open_location(str(tmp_path))
    assert read_evaluated(storage) is None
    write_evaluated(storage, {"probe": [4, 2], "eval": [250]})
    assert (tmp_path / "evaluated.json").read_text() == '{"eval":[250],"probe":[2,4]}\n'
    assert read_evaluated(storage) == {"eval": [250], "probe": [2, 4]}
    deep = b"[" * 200_000 + b"]" * 200_000
    boolean, huge = b'{"probe": [true, 4]}', b'{"probe": [%d]}' % 2**63
    for bad in (
        b"",
        b"{",
        b'{"probe": [2, "4"]}',
        b'{"probe": [-1]}',
        b"[]",
        b"\xff",
        deep,
        boolean,
        huge,
    ):
        (tmp_path / "evaluated.json").write_bytes(bad)
        with pytest.raises(CheckpointError) as caught:
            read_evaluated(storage)
        assert caught.value.code == "E-EVAL-003"
        assert "\n" not in str(caught.value)


SECOND_RUNNER = """
from sexpgpu.extension import EvaluatorInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_evaluators():
    return [EvaluatorInfo("mine", lambda metrics: None)]
"""


def test_a_second_eval_pass_runner_is_a_conflict_naming_both(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "r.sx").write_text(Path(__file__).with_name("eval.sx").read_text())
    plugin = make_plugin(
        tmp_path / "p",
        "sexpgpu-runner",
        {"sexpgpu_runner": SECOND_RUNNER},
        {"runner": "sexpgpu_runner"},
    )
    env = sexpgpu_env(PYTHONPATH=str(plugin))
    result = run_sexpgpu("run", "r.sx", "--metrics-dir", "m", cwd=tmp_path / "w", env=env)
    assert result.returncode == 1
    assert (
        "sexpgpu run: step 1: E-PLUGIN-001: eval passes (:evals) is supplied by more than one plugin"
        in result.stderr
    )
    assert "'eval' (sexpgpu's own plugin) and 'runner' (sexpgpu-runner 0.1)" in result.stderr
    listed = run_sexpgpu("plugins", cwd=tmp_path / "w", env=env)
    assert "eval-pass runner" in listed.stdout + listed.stderr


def test_a_huge_evaluated_json_is_refused_from_its_first_bytes(tmp_path):
    # a sparse file of 4 GB: read whole, it would take 4 GB of memory
    with open(tmp_path / "evaluated.json", "wb") as f:
        f.truncate(4 << 30)
    with pytest.raises(CheckpointError) as caught:
        read_evaluated(open_location(str(tmp_path)))
    assert caught.value.code == "E-EVAL-003"
    assert "it is over 67108864 bytes" in str(caught.value)


class TogetherTrainer(FakeTrainer):
    """A trainer whose first evaluate after a step is a collective (sharded parameters)."""

    evaluates_together = True


@pytest.mark.parametrize(("batches", "split"), [(3, True), (1, False)])
def test_a_trainer_that_evaluates_together_gets_a_call_on_every_rank(batches, split):
    # with fewer batches than ranks a rank would have none, and its peers would wait in
    # its first evaluate's gather: every rank then runs every batch
    class Pass(FakePass):
        pass

    Pass.batches = batches
    second = TogetherTrainer()
    PassRunner({}).run_pass(
        Pass(),
        second,
        seed=7,
        open_batches=lambda p, s: counting(),
        stopping=lambda: False,
        group=HalfOfTwo(1),
    )
    assert [int(x) for x in second.batches] == ([2] if split else [1])
