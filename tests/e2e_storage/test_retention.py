"""Retention in buckets: `--keep-last 2` keeps the newest two complete checkpoints on
s3:// and gs://, and `kill -9` at random moments (some of them in the middle of a
deletion) leaves `--resume latest` working, to the bit of a run never stopped."""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.e2e.helpers import (
    deleting,
    keep_file,
    reference_run,
    run_sexpgpu,
    start_sexpgpu,
    tensors,
)
from tests.e2e_storage.buckets import CHECKPOINT_FILES, Bucket
from tests.servers import unique_prefix

pytestmark = pytest.mark.slow

STEPS = 16


def folders(bucket: Bucket, prefix: str) -> dict[int, set[str]]:
    """Each step folder's files."""
    found: dict[int, set[str]] = {}
    for key in bucket.objects(prefix):
        folder, _, name = key.partition("/")
        if folder.startswith("step-"):
            found.setdefault(int(folder[5:]), set()).add(name)
    return found


def test_keep_last_and_kill_9_during_deletions(bucket: Bucket, workdir):
    source = keep_file(workdir, every=1)
    reference = reference_run(workdir, source, STEPS)
    prefix = unique_prefix()
    args = ["run", source, "--steps", str(STEPS), "--checkpoint-dir", bucket.uri(prefix)]
    args += ["--resume", "latest", "--keep-last", "2", "--metrics-dir", "m"]
    chance = random.Random()
    killed = 0
    for attempt in range(5):
        proc = start_sexpgpu(*args, cwd=workdir, env=bucket.env())
        # A moment of the run's progress, not of the clock (a start-up may take 0.3 s
        # or 3 s): a deletion part way, or a random step's checkpoint stored.
        at_step = chance.randint(2, STEPS - 3)
        try:
            deadline = time.monotonic() + 120  # only guards against a hang
            while time.monotonic() < deadline and proc.poll() is None:
                by_step = folders(bucket, prefix)
                stored = [n for n, files in by_step.items() if "experiment.json" in files]
                if (attempt % 2 == 0 and deleting(by_step)) or max(stored, default=0) >= at_step:
                    break
                time.sleep(0.005)
        finally:
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=60)
        assert proc.returncode in (-signal.SIGKILL, 0), err
        killed += proc.returncode == -signal.SIGKILL
        for step, files in folders(bucket, prefix).items():
            if "experiment.json" in files:  # a complete checkpoint is whole
                assert set(CHECKPOINT_FILES) <= files, (step, files)
    assert killed >= 3, "the runs ended before the kills: they tested nothing"
    final = run_sexpgpu(*args, cwd=workdir, env=bucket.env())
    assert final.returncode == 0, final.stderr
    complete = sorted(n for n, f in folders(bucket, prefix).items() if "experiment.json" in f)
    if "nothing to do" in final.stderr:
        # A kill after the last checkpoint cut its deletions off; a finished run run
        # again changes nothing, and only a later write would remove that one (docs/run.md).
        assert complete[-2:] == [STEPS - 1, STEPS] and len(complete) <= 3, complete
    else:
        assert complete == [STEPS - 1, STEPS]
    last = f"step-{STEPS:08d}"
    assert bucket.tensors(f"{prefix}/{last}") == tensors(reference / last)
