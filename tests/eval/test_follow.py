"""`sexpgpu evaluate --follow`: every new checkpoint, `evaluated.json`, and its window."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.e2e.helpers import events, run_sexpgpu, sexpgpu_env, start_sexpgpu
from tests.foundation.pluginkit import make_plugin

from .kit import RUN, eval_points, evaluated, one_line, the_run, train

FOLLOW = ["evaluate", "ck", "--follow", "--poll", "0.2", "--metrics-dir", "m"]
ALL = {"probe": [2, 4, 6], "final": [6]}
"""What a follower of eval.sx evaluates: probe at every checkpoint (:every 2), final
only at the finished one (its :every 3 falls on step 3, which has no checkpoint)."""


def follow(workdir: Path, env: dict | None = None):
    return run_sexpgpu(*FOLLOW, cwd=workdir, env=env)


def wait_for(check, proc, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"ended before {what}: rc={proc.returncode}\n{out}\n{err}")
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.02)


def test_a_finished_run_is_followed_to_its_end_and_marked(workdir):
    train(workdir)
    result = follow(workdir)
    assert result.returncode == 0, result.stderr
    assert evaluated(workdir / "ck") == ALL
    assert "followed ck to its finished step 6" in result.stderr
    ran = eval_points(workdir, source=None)
    again = eval_points(workdir, source="evaluate")
    assert sorted(again) == sorted(k for k in ran if k[0] != 3)  # step 3: no checkpoint
    assert all(again[key] == ran[key] for key in again)
    # restarted, it continues from evaluated.json: nothing is evaluated again
    assert follow(workdir).returncode == 0
    assert eval_points(workdir, source="evaluate") == again
    # deleting evaluated.json evaluates again
    (workdir / "ck" / "evaluated.json").unlink()
    assert follow(workdir).returncode == 0
    assert all(len(v) == 2 for v in eval_points(workdir, source="evaluate").values())


def test_a_corrupt_evaluated_json_is_one_line_and_nothing_is_evaluated(workdir):
    train(workdir)
    deep = "[" * 200_000 + "]" * 200_000  # past the parser's recursion
    for text in ("{not json", '{"probe": "2,4"}', "[2, 4]", deep, '{"probe":[true,4]}'):
        (workdir / "ck" / "evaluated.json").write_text(text)
        result = follow(workdir)
        assert result.returncode == 1
        line = one_line(result.stderr)
        assert line.startswith("sexpgpu evaluate: E-EVAL-003: ck/evaluated.json is not what")
        assert line.endswith("delete it to evaluate every checkpoint again")
        assert (workdir / "ck" / "evaluated.json").read_text() == text
    assert not eval_points(workdir, source="evaluate")


def test_a_location_that_cannot_be_listed_is_an_error(workdir):
    (workdir / "ck").write_text("a file where the checkpoint folder should be")
    result = follow(workdir)
    assert result.returncode != 0
    assert "E-STORAGE-004" in one_line(result.stderr)


def test_the_run_and_its_follower_at_once(workdir):
    follower = start_sexpgpu(*FOLLOW, cwd=workdir)
    try:
        run = run_sexpgpu(*RUN, "--steps", "12", cwd=workdir)
        assert run.returncode == 0, run.stderr
        out, err = follower.communicate(timeout=300)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    assert evaluated(workdir / "ck") == {"probe": [2, 4, 6, 8, 10, 12], "final": [6, 12]}
    lines = (the_run(workdir) / "events.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]  # no line torn by the other writer
    assert len({e["id"] for e in parsed}) == len(parsed)
    ran = eval_points(workdir, source=None)
    again = eval_points(workdir, source="evaluate")
    assert again and all(again[key] == ran[key] for key in again)
    assert [e["kind"] for e in parsed].count("done") == 1


def test_a_signal_stops_the_follower_and_a_restart_continues(workdir):
    train(workdir)
    aside = workdir / "step-6-aside"
    (workdir / "ck" / "step-00000006").rename(aside)  # unfinished so far: it waits
    follower = start_sexpgpu(*FOLLOW, cwd=workdir)
    try:
        marked = workdir / "ck" / "evaluated.json"
        wait_for(
            lambda: marked.exists() and json.loads(marked.read_text()) == {"probe": [2, 4]},
            follower,
            "steps 2 and 4 marked",
        )
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 128 + signal.SIGTERM
    assert "sexpgpu evaluate: interrupted by SIGTERM at step 4" in err
    # the run's last checkpoint comes; a restarted follower takes up from evaluated.json
    aside.rename(workdir / "ck" / "step-00000006")
    assert follow(workdir).returncode == 0
    assert evaluated(workdir / "ck") == ALL
    assert all(len(v) == 1 for v in eval_points(workdir, source="evaluate").values())


# A sink that blocks on the points of one step: delivery never completes.
STUCK_SINK = """
import json, os, time

from sexpgpu.extension import MetricsSinkInfo
from sexpgpu.hookspecs import hookimpl


class Stuck:
    name = "stuck"

    def write(self, events):
        if any(e.get("evaluation") == os.environ["STUCK_AT"] for e in events):
            open(os.environ["STUCK_FLAG"], "w").close()
            time.sleep(3600)

    def close(self):
        pass


@hookimpl
def sexpgpu_metrics_sinks():
    return [MetricsSinkInfo("stuck", lambda folder, slug: Stuck())]
"""

# Local checkpoints whose evaluated.json writes block: delivered, never marked.
SLOW_MARK = """
import os, time

from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.catalog import Catalog


class SlowMark:
    def __init__(self, uri):
        self.inner = Catalog.load().open_location(uri.removeprefix("slowmark://"))
        self.uri = uri

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, data):
        if key == "evaluated.json" and b"4" in bytes(data):
            open(os.environ["MARK_FLAG"], "w").close()
            time.sleep(3600)
        self.inner.write(key, data)


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(("slowmark",), SlowMark)]
"""


def _has_point(workdir, step: int) -> bool:
    try:
        return (step, "probe/loss") in eval_points(workdir, source="evaluate")
    except ValueError:  # a line the sink is writing right now
        return False


def test_killed_before_delivery_is_complete_the_step_is_not_marked(workdir, tmp_path):
    train(workdir)
    plugin = make_plugin(
        tmp_path / "p", "sexpgpu-stuck", {"sexpgpu_stuck": STUCK_SINK}, {"stuck": "sexpgpu_stuck"}
    )
    flag = tmp_path / "stuck"
    env = sexpgpu_env(PYTHONPATH=str(plugin), STUCK_AT="probe@4", STUCK_FLAG=str(flag))
    follower = start_sexpgpu(
        *FOLLOW, "--metrics-sink", "jsonl", "--metrics-sink", "stuck", cwd=workdir, env=env
    )
    try:
        wait_for(flag.exists, follower, "the sink stuck on step 4")
        # each sink has its own thread: the jsonl one may write step 4 a moment later
        wait_for(lambda: _has_point(workdir, 4), follower, "step 4 in the jsonl sink")
        assert evaluated(workdir / "ck") == {"probe": [2]}  # step 4 is not marked
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=60)
    finally:
        follower.kill()
    assert follow(workdir).returncode == 0
    assert evaluated(workdir / "ck") == ALL
    points = eval_points(workdir, source="evaluate")
    assert len(points[(2, "probe/loss")]) == 1  # marked: not evaluated again
    # step 4 reached the jsonl sink before the kill, and is evaluated again: both kept
    assert len(points[(4, "probe/loss")]) == 2


def test_killed_after_delivery_and_before_marking_the_step_is_evaluated_again(workdir, tmp_path):
    train(workdir)
    plugin = make_plugin(
        tmp_path / "p",
        "sexpgpu-slowmark",
        {"sexpgpu_slowmark": SLOW_MARK},
        {"slowmark": "sexpgpu_slowmark"},
    )
    flag = tmp_path / "marking"
    env = sexpgpu_env(PYTHONPATH=str(plugin), MARK_FLAG=str(flag))
    args = ["evaluate", f"slowmark://{workdir / 'ck'}", "--follow", "--metrics-dir", "m"]
    follower = start_sexpgpu(*args, cwd=workdir, env=env)
    try:
        wait_for(flag.exists, follower, "the mark of step 4")
        # delivered: the points of step 4 are in the experiment before the mark
        assert eval_points(workdir, source="evaluate")[(4, "probe/loss")]
        assert evaluated(workdir / "ck") == {"probe": [2]}
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=60)
    finally:
        follower.kill()
    assert follow(workdir).returncode == 0
    assert evaluated(workdir / "ck") == ALL
    points = eval_points(workdir, source="evaluate")
    assert len(points[(2, "probe/loss")]) == 1
    assert len(points[(4, "probe/loss")]) == 2  # the one repeat the spec allows
    assert points[(4, "probe/loss")][0] == points[(4, "probe/loss")][1]
    tags = [
        e["evaluation"]
        for e in events(the_run(workdir))
        if e.get("name") == "probe/loss" and e.get("source") == "evaluate"
    ]
    assert tags.count("probe@4") == 2


def test_a_checkpoint_with_nothing_due_is_passed_over_unread(workdir):
    text = (workdir / "eval.sx").read_text().replace(":every 2 :batches", ":every 4 :batches")
    (workdir / "eval.sx").write_text(text)
    train(workdir)
    # step 2 owes no pass: a follower never reads its parameters, damaged or not
    (workdir / "ck" / "step-00000002" / "params.safetensors").write_bytes(b"damaged")
    result = follow(workdir)
    assert result.returncode == 0, result.stderr
    assert evaluated(workdir / "ck") == {"probe": [4, 6], "final": [6]}
