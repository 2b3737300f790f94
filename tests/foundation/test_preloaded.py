"""The suite's forked `sexpgpu` processes (tests/preloaded.py) behave as fresh ones.

The harness stands in for a fresh interpreter in most end-to-end tests, so it is
checked against one here: the same command, run both ways, ends the same way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import preloaded
from tests.catalogs import tiny_program

SEXPGPU = [sys.executable, "-c", preloaded.CONSOLE_CODE]


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def timeless(log: str) -> str:
    """``log`` without the times its lines carry."""
    return re.sub(r'"timestamp": "[^"]*"', '"timestamp": ""', log)


def both_ways(args: list[str], *, cwd: Path, env: dict[str, str]):
    """``sexpgpu ARGS`` forked (twice: the first sighting of a setting starts fresh)
    and in a fresh interpreter: (forked result, fresh result)."""
    command = [*SEXPGPU, *args]
    for _ in range(2):
        forked = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    fresh = preloaded._ORIGINAL_POPEN(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = fresh.communicate(timeout=120)
    return forked, (fresh.returncode, out, err)


def test_a_user_error_ends_the_same_way_forked_or_fresh(tmp_path, env):
    (tmp_path / "bad.sx").write_text("(model m (linear 4\n")
    forked, fresh = both_ways(["run", "bad.sx", "--steps", "1"], cwd=tmp_path, env=env)
    assert (forked.returncode, forked.stdout, timeless(forked.stderr)) == (
        fresh[0],
        fresh[1],
        timeless(fresh[2]),
    )
    assert forked.returncode != 0 and "Traceback" not in forked.stderr


def test_a_run_writes_the_same_checkpoint_bytes_forked_or_fresh(tmp_path, env):
    results = {}
    for way in ("forked", "fresh"):
        folder = tmp_path / way
        folder.mkdir()
        (folder / "tiny.sx").write_text(tiny_program("tiny", checkpoint_every=2))
        args = [*SEXPGPU, "run", "tiny.sx", "--checkpoint-dir", "ckpt"]
        if way == "forked":
            subprocess.run(args, cwd=folder, env=env, capture_output=True)  # a first sighting
            done = subprocess.run(args[:-2] + ["--checkpoint-dir", "c2"], cwd=folder, env=env,
                                  capture_output=True, text=True)  # fmt: skip
            assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 0
            results[way] = folder / "c2"
        else:
            proc = preloaded._ORIGINAL_POPEN(args, cwd=folder, env=env)
            assert proc.wait(120) == 0
            results[way] = folder / "ckpt"
    forked = sorted(
        p.relative_to(results["forked"]) for p in results["forked"].rglob("*.safetensors")
    )
    fresh = sorted(p.relative_to(results["fresh"]) for p in results["fresh"].rglob("*.safetensors"))
    assert forked == fresh and len(forked) == 4  # two checkpoints of two tensor files
    for name in forked:
        assert (results["forked"] / name).read_bytes() == (results["fresh"] / name).read_bytes()


def test_a_forked_child_is_the_pid_the_test_signals_and_reports_its_death(tmp_path, env):
    long = tiny_program("long", checkpoint_every=1).replace(":steps 4", ":steps 1000000")
    (tmp_path / "long.sx").write_text(long)
    args = [*SEXPGPU, "run", "long.sx", "--checkpoint-dir", "ckpt"]
    subprocess.run([*SEXPGPU, "run", "missing.sx"], cwd=tmp_path, env=env, capture_output=True)
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc._forked is not None, "the second sighting of these settings is forked"
    deadline = time.monotonic() + 120
    while not (tmp_path / "ckpt").exists():  # the child is training
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    proc.stdout.close()
    proc.stderr.close()


def test_what_a_fork_cannot_honour_starts_a_fresh_interpreter(tmp_path, env):
    other = {**env, "OMP_NUM_THREADS": "2"}
    for _ in range(1):  # a setting seen once is not worth a preloader
        proc = subprocess.Popen([*SEXPGPU, "run", "missing.sx"], cwd=tmp_path, env=other,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        assert proc._forked is None
        proc.wait(60)
    check = subprocess.Popen([*SEXPGPU, "check", "missing.sx"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    assert check._forked is None, "only the commands that import torch are forked"
    check.wait(60)
    with_hook = subprocess.Popen([*SEXPGPU, "run", "missing.sx"], cwd=tmp_path, env=env,
                                 preexec_fn=os.getpid, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)  # fmt: skip
    assert with_hook._forked is None
    with_hook.wait(60)


@pytest.mark.fresh_process
def test_a_test_marked_fresh_process_forks_nothing(tmp_path, env):
    for _ in range(3):
        proc = subprocess.Popen([*SEXPGPU, "run", "missing.sx"], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        assert proc._forked is None
        proc.wait(60)
