"""Retention: `:keep-last N` in `defrun` and `--keep-last N` keep the newest N complete
checkpoints; a deletion removes experiment.json first, so `kill -9` in the middle of
one leaves `--resume latest` working, to the bit."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from sexpgpu.checkpoint.retention import delete_checkpoint, list_steps, prune
from tests.catalogs import open_location
from tests.e2e.helpers import refused_in_process
from tests.foundation.pluginkit import make_plugin

from .helpers import (
    assert_same_tensors,
    deleting,
    events,
    experiments,
    keep_file,
    reference_run,
    run_sexpgpu,
    sexpgpu_env,
    start_sexpgpu,
    step_dirs,
)

CHECKPOINT_FILES = {"experiment.json", "params.safetensors", "state.json", "states.safetensors"}


def records(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_keep_last_in_defrun_keeps_the_newest_complete_checkpoints(workdir):
    run = ["run", keep_file(workdir, "2"), "--steps", "10", "--checkpoint-dir", "ckpt"]
    result = run_sexpgpu(*run, "--metrics-dir", "m", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert step_dirs(workdir / "ckpt") == ["step-00000008", "step-00000010"]
    deleted = [r["location"] for r in records(result.stderr) if r["event"] == "checkpoint deleted"]
    assert deleted == [f"ckpt/step-{n:08d}" for n in (2, 4, 6)]
    # every checkpoint was reported when it was stored, deleted or not
    (run_dir,) = experiments(workdir / "m")
    notes = [e["step"] for e in events(run_dir) if e["kind"] == "annotation"]
    assert notes == [2, 4, 6, 8, 10]


def test_the_command_line_wins_over_the_file(workdir):
    run = ["run", keep_file(workdir, "3"), "--steps", "10", "--checkpoint-dir", "ckpt"]
    result = run_sexpgpu(*run, "--keep-last", "1", "--metrics-dir", "m", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert step_dirs(workdir / "ckpt") == ["step-00000010"]
    without = run_sexpgpu(*run[:-1], "ckpt2", "--metrics-dir", "m", cwd=workdir)
    assert without.returncode == 0, without.stderr
    assert step_dirs(workdir / "ckpt2") == ["step-00000006", "step-00000008", "step-00000010"]


def test_keep_last_is_at_least_one(workdir):
    result = refused_in_process("run", keep_file(workdir, "0"), cwd=workdir)
    assert result.returncode != 0
    assert "keep.sx:" in result.stderr and ":keep-last must be an integer >= 1, got 0" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    flag = refused_in_process("run", "examples/my-run.sx", "--keep-last", "0", cwd=workdir)
    assert flag.returncode == 2 and "0 is not in the range x>=1" in flag.stderr


# ---------------------------------------------------------------- the helpers


class Recording:
    """A storage that records the order of deletions (over a real local location)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.deleted: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        self.inner.delete(key)


def make_step(root: Path, step: int, *, complete: bool = True) -> None:
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    for name in CHECKPOINT_FILES - ({"experiment.json"} if not complete else set()):
        (folder / name).write_bytes(b"{}")


def test_prune_deletes_only_old_complete_checkpoints_experiment_json_first(tmp_path):
    for step in (1, 2, 3, 5):
        make_step(tmp_path, step)
    make_step(tmp_path, 4, complete=False)  # a write cut off, or one being written
    (tmp_path / "notes").mkdir()
    storage = Recording(open_location(str(tmp_path)))
    assert [(s.step, s.complete) for s in list_steps(storage)] == [
        (1, True),
        (2, True),
        (3, True),
        (4, False),
        (5, True),
    ]
    assert prune(storage, 2) == ["step-00000001", "step-00000002"]
    # the local backend removes the folders the deletions leave empty
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-00000003",
        "step-00000004",
        "step-00000005",
    ]
    for key in ("step-00000001", "step-00000002"):
        mine = [k for k in storage.deleted if k.startswith(key)]
        assert mine[0] == f"{key}/experiment.json"
        assert {k.split("/")[1] for k in mine} == CHECKPOINT_FILES
    assert (tmp_path / "step-00000004" / "params.safetensors").exists()
    assert (tmp_path / "notes").is_dir()


def test_prune_never_deletes_the_newest_complete_or_a_protected_one(tmp_path):
    for step in (1, 2, 3):
        make_step(tmp_path, step)
    storage = open_location(str(tmp_path))
    # one just written at a lower step (a resume from an older checkpoint) is protected
    assert prune(storage, 1, protect=["step-00000001"]) == ["step-00000002"]
    assert [s.step for s in list_steps(storage) if s.complete] == [1, 3]
    with pytest.raises(ValueError):
        prune(storage, 0)
    delete_checkpoint(storage, "step-00000003")
    assert [s.step for s in list_steps(storage) if s.complete] == [1]
    assert prune(storage, 1) == []


# ------------------------------------------------- kill -9 during deletions

SLOW_PLUGIN = '''
"""slow://PATH: a local folder whose deletions are slow, so a test can kill a run mid-way."""

import os
import time

from sexpgpu.errors import StorageError
from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.catalog import Catalog


class SlowStorage:
    def __init__(self, uri):
        self.uri = uri.rstrip("/")
        self.inner = Catalog.load().open_location(self.uri.removeprefix("slow://"))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, key):
        time.sleep(float(os.environ.get("SLOW_DELETE_SECONDS", "0")))
        if os.environ.get("SLOW_REFUSE_DELETES") and self.inner.exists(key):
            raise StorageError(f"{self.uri}/{key}: deleting refused (the test plugin)")
        self.inner.delete(key)


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(schemes=("slow",), factory=SlowStorage, doc="slow deletes")]
'''

STEPS = 24


def slow_plugin(tmp_path: Path) -> Path:
    return make_plugin(
        tmp_path / "plugins",
        "sexpgpu-slow-plugin",
        {"sexpgpu_slow": SLOW_PLUGIN},
        {"slow": "sexpgpu_slow"},
    )


def test_a_deletion_that_fails_is_a_warning_and_the_run_goes_on(workdir, tmp_path):
    env = sexpgpu_env(PYTHONPATH=str(slow_plugin(tmp_path)), SLOW_REFUSE_DELETES="1")
    root = workdir / "ckpt"
    result = run_sexpgpu(
        "run",
        keep_file(workdir, "1"),
        "--steps",
        "6",
        "--checkpoint-dir",
        f"slow://{root}",
        "--metrics-dir",
        "m",
        cwd=workdir,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    warnings = [r for r in records(result.stderr) if r["event"] == "old checkpoints not deleted"]
    assert len(warnings) == 2 and "deleting refused (the test plugin)" in warnings[0]["error"]
    assert step_dirs(root) == ["step-00000002", "step-00000004", "step-00000006"]
    (summary,) = [r for r in records(result.stderr) if r["event"] == "run finished"]
    assert summary["checkpoint"] == f"slow://{root}/step-00000006"


def local_folders(root: Path) -> dict[int, set[str]]:
    """Each step folder's file names under a local checkpoint location."""
    if not root.exists():
        return {}
    return {
        int(p.name[5:]): {f.name for f in p.iterdir()}
        for p in root.iterdir()
        if p.name.startswith("step-")
    }


def assert_complete_ones_whole(root: Path) -> None:
    for folder in root.iterdir():
        if (folder / "experiment.json").exists():
            assert CHECKPOINT_FILES <= {p.name for p in folder.iterdir()}, folder


def test_kill_9_during_deletions_leaves_resume_latest_working(workdir, tmp_path):
    plugins = slow_plugin(tmp_path)
    source = keep_file(workdir, "2", every=1)
    reference = reference_run(workdir, source, STEPS)
    env = sexpgpu_env(PYTHONPATH=str(plugins), SLOW_DELETE_SECONDS="0.04")
    root = workdir / "ckpt"
    args = ["run", source, "--steps", str(STEPS), "--checkpoint-dir", f"slow://{root}"]
    args += ["--resume", "latest", "--metrics-dir", "m"]
    chance = random.Random()
    mid_deletion = 0
    for attempt in range(8):
        proc = start_sexpgpu(*args, cwd=workdir, env=env)
        try:
            deadline = time.monotonic() + 120  # only guards against a hang
            # Half the kills wait for a deletion part way, half come at a random moment.
            wait_deleting = attempt % 2 == 0
            at = time.monotonic() + chance.uniform(1.5, 3.0)
            while time.monotonic() < deadline and proc.poll() is None:
                if deleting(local_folders(root)) if wait_deleting else time.monotonic() >= at:
                    mid_deletion += deleting(local_folders(root))
                    break
                time.sleep(0.002)
        finally:
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=60)
        assert proc.returncode in (-signal.SIGKILL, 0), err
        assert_complete_ones_whole(root)
    assert mid_deletion >= 2, "no kill landed during a deletion"
    final = run_sexpgpu(*args, cwd=workdir, env=env)
    assert final.returncode == 0, final.stderr
    last = f"step-{STEPS:08d}"
    assert [f.step for f in list_steps(open_location(str(root))) if f.complete][-2:] == [
        STEPS - 1,
        STEPS,
    ]
    assert_same_tensors(reference / last, root / last)
