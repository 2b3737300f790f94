"""examples/rl-sort.sx end to end: imitation, then a policy gradient on sampled answers;
its generating pass rises, `sexpgpu evaluate` gives the run's own numbers for it, and
`sexpgpu report` charts it (docs/generate.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, events, run_sexpgpu

from .kit import eval_points, the_run

IMITATE, TOTAL = 40, 200


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("rl-sort")
    shutil.copy(EXAMPLES / "rl-sort.sx", workdir / "rl-sort.sx")
    result = run_sexpgpu(
        "run", "rl-sort.sx", "--checkpoint-dir", "ck", "--metrics-dir", "m", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.mark.slow
def test_the_sampled_reward_rises_in_the_stage_that_samples(trained):
    points = eval_points(trained, source=None)
    reward = {
        step: values[0] for (step, name), values in points.items() if name == "sampled/reward"
    }
    assert sorted(reward) == list(range(20, TOTAL + 1, 20))
    # the imitation stage leaves it at reward[40]; sampling and the verifier take it higher
    last = [reward[step] for step in (160, 180, 200)]
    assert min(last) > reward[IMITATE] + 0.05, reward
    counted = {
        e["step"]: e["value"]
        for e in events(the_run(trained))
        if e.get("kind") == "point" and e["name"] == "generated"
    }
    assert counted[IMITATE] == 0  # imitation generates nothing
    # stage 2: 8 prompts * 8 samples * at most 7 tokens a step, at least 1 each
    assert 64 * (TOTAL - IMITATE) <= counted[TOTAL] <= 7 * 64 * (TOTAL - IMITATE)


@pytest.mark.slow
def test_evaluate_gives_the_run_s_own_numbers_for_a_pass_that_generates(trained):
    for step in (IMITATE, TOTAL):
        result = run_sexpgpu(
            "evaluate",
            f"ck/step-{step:08d}",
            "--pass",
            "sampled",
            "--metrics-dir",
            "m",
            cwd=trained,
        )
        assert result.returncode == 0, result.stderr
    ran = eval_points(trained, source=None)
    again = eval_points(trained, source="evaluate")
    assert sorted(again) == [
        (IMITATE, "sampled/generated-length"),
        (IMITATE, "sampled/reward"),
        (TOTAL, "sampled/generated-length"),
        (TOTAL, "sampled/reward"),
    ]
    for key, values in again.items():
        assert values == ran[key], key  # the same draws, the same float


@pytest.mark.slow
def test_the_report_charts_the_generating_pass(trained):
    run = the_run(trained).name
    result = run_sexpgpu("report", run, "--metrics-dir", "m", cwd=trained)
    assert result.returncode == 0, result.stderr
    assert (the_run(trained) / "report" / "eval-sampled-reward.png").stat().st_size > 0
