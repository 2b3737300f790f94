"""Retention and a follower at one location: the run keeps what the follower has not
evaluated (within ``SEXPGPU_KEEP_UNEVALUATED``), and a due step deleted anyway is
reported by the follower, each one, never lost in silence."""

from __future__ import annotations

import json
from pathlib import Path

from sexpgpu.checkpoint.evaluated import unevaluated
from sexpgpu.checkpoint.retention import prune
from tests.catalogs import open_location
from tests.e2e.helpers import events, run_sexpgpu, sexpgpu_env, start_sexpgpu

from .kit import RUN, evaluated, one_line, the_run
from .test_follow import FOLLOW, wait_for

PASSES = [("probe", 2), ("final", 3)]


def _checkpoints(root: Path, steps: list[int]) -> None:
    for step in steps:
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "experiment.json").write_text("{}")


def _left(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


def test_retention_holds_the_oldest_unevaluated_due_checkpoints_up_to_the_bound(tmp_path):
    _checkpoints(tmp_path, [2, 4, 5, 6, 8, 10, 12])
    storage = open_location(str(tmp_path))

    def hold(limit: int):
        return lambda old: unevaluated(storage, old, PASSES, limit)

    # no evaluated.json: no follower, plain :keep-last
    assert prune(storage, 5, hold=hold(8)) == ["step-00000002", "step-00000004"]
    _checkpoints(tmp_path, [2, 4])
    # a follower has evaluated probe at 2 only: 4 is owed (probe), 5 is due nowhere
    (tmp_path / "evaluated.json").write_text('{"probe":[2]}')
    assert prune(storage, 1, hold=hold(8)) == ["step-00000002", "step-00000005"]
    assert _left(tmp_path) == [4, 6, 8, 10, 12]
    # at most `limit` held, the oldest first (the follower reaches them first)
    assert prune(storage, 1, hold=hold(2)) == ["step-00000008", "step-00000010"]
    assert _left(tmp_path) == [4, 6, 12]
    # `final` evaluated at 6 but not probe: still owed; everything evaluated: deleted
    (tmp_path / "evaluated.json").write_text('{"final":[6],"probe":[4,6]}')
    assert prune(storage, 1, hold=hold(8)) == ["step-00000004", "step-00000006"]
    # an unreadable evaluated.json holds within the bound rather than guess
    _checkpoints(tmp_path, [2, 4])
    (tmp_path / "evaluated.json").write_text("{not json")
    assert prune(storage, 1, hold=hold(1)) == ["step-00000004"]


def test_a_bound_that_is_not_a_whole_number_is_one_line(workdir):
    env = sexpgpu_env(SEXPGPU_KEEP_UNEVALUATED="-1")
    result = run_sexpgpu(*RUN, "--keep-last", "1", cwd=workdir, env=env)
    line = one_line(result.stderr)
    assert result.returncode == 1
    assert line == "sexpgpu run: SEXPGPU_KEEP_UNEVALUATED must be at least 0, not -1", line


def test_a_follower_present_loses_no_due_step_to_keep_last_one(workdir):
    steps = 40
    env = sexpgpu_env(SEXPGPU_KEEP_UNEVALUATED=str(steps))
    follower = start_sexpgpu(*FOLLOW, cwd=workdir, env=env)
    try:
        # the follower says it is there before the run's first checkpoint
        wait_for(lambda: (workdir / "ck" / "evaluated.json").exists(), follower, "evaluated.json")
        run = run_sexpgpu(*RUN, "--steps", str(steps), "--keep-last", "1", cwd=workdir, env=env)
        assert run.returncode == 0, run.stderr
        out, err = follower.communicate(timeout=300)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    assert f"followed ck to its finished step {steps}\n" in err, err
    done = evaluated(workdir / "ck")
    assert done["probe"] == list(range(2, steps + 1, 2))
    assert done["final"] == [*range(6, steps, 6), steps]


def test_each_due_step_deleted_before_the_follower_came_is_reported(workdir):
    run = run_sexpgpu(*RUN, "--steps", "12", "--keep-last", "1", cwd=workdir)
    assert run.returncode == 0, run.stderr
    result = run_sexpgpu(*FOLLOW, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "sexpgpu evaluate: followed ck to its finished step 12; 5 due checkpoints were "
        "deleted before they were evaluated (steps 2, 4, 6, 8, 10)"
    )
    logged = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    warned = [r for r in logged if r["event"] == "checkpoint deleted before it was evaluated"]
    assert [(r["checkpoint"], r["passes"]) for r in warned] == [
        ("ck/step-00000002", ["probe"]),
        ("ck/step-00000004", ["probe"]),
        ("ck/step-00000006", ["probe", "final"]),
        ("ck/step-00000008", ["probe"]),
        ("ck/step-00000010", ["probe"]),
    ]
    notes = [
        (e["step"], e["text"])
        for e in events(the_run(workdir))
        if e["kind"] == "annotation" and e["text"].startswith("not evaluated")
    ]
    assert notes[2] == (
        6,
        "not evaluated: ck/step-00000006 (probe, final) was deleted before evaluate "
        "--follow read it",
    )
    assert [step for step, _ in notes] == [2, 4, 6, 8, 10]
    assert evaluated(workdir / "ck") == {"final": [12], "probe": [12]}
