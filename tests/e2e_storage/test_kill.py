"""`kill -9` while a checkpoint is being uploaded, several times at different moments:
`--resume latest` passes over the checkpoint cut off, takes the newest complete one and
finishes with the tensors of a run never stopped, byte for byte."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, events, experiments, run_sexpgpu, start_sexpgpu, status
from tests.e2e_storage.buckets import Bucket, assert_same_tensors
from tests.servers import unique_prefix

pytestmark = pytest.mark.slow

STEPS = 8
# tiny-lm at width 256: a ~19 MB checkpoint (6.4 MB of parameters, 12.8 MB of AdamW
# states, a multipart upload) every step, so an upload takes long enough to be caught.
RUN = [
    "run",
    "examples/tiny-lm.sx",
    "--set",
    "dim=256",
    "--set",
    "checkpoint-every=1",
    "--steps",
    str(STEPS),
    "--metrics-dir",
    "m",
]

Files = frozenset[str]
# When to kill, by the files of one step already in the bucket (never experiment.json).
MOMENTS: dict[str, Callable[[Files], bool]] = {
    "the first file seen": lambda files: bool(files),
    "parameters stored, states not": lambda files: (
        "params.safetensors" in files and "states.safetensors" not in files
    ),
    "state.json alone": lambda files: files == {"state.json"},
}


@pytest.fixture(scope="module")
def reference(bucket: Bucket, tmp_path_factory) -> str:
    """The prefix of an uninterrupted run with the same knobs."""
    root = tmp_path_factory.mktemp(f"kill-reference-{bucket.scheme}")
    shutil.copytree(EXAMPLES, root / "examples")
    prefix = unique_prefix()
    done = run_sexpgpu(*RUN, "--checkpoint-dir", bucket.uri(prefix), cwd=root, env=bucket.env())
    assert done.returncode == 0, done.stderr
    return prefix


def partial_steps(bucket: Bucket, prefix: str) -> dict[int, Files]:
    """Each step folder's files, for the steps without experiment.json."""
    by_step: dict[int, set[str]] = {}
    for key in bucket.objects(prefix):
        folder, _, name = key.partition("/")
        if folder.startswith("step-"):
            by_step.setdefault(int(folder[5:]), set()).add(name)
    return {n: frozenset(f) for n, f in by_step.items() if "experiment.json" not in f}


def losses(workdir) -> int:
    """How many loss points the metrics stream holds so far."""
    runs = experiments(workdir / "m")
    return sum(1 for r in runs for e in events(r) if e.get("name") == "loss")


def wait_for_more_losses(workdir, counted: int, proc) -> None:
    """Wait until the stream holds more loss points than ``counted``."""
    deadline = time.monotonic() + 180  # only guards against a hang
    while losses(workdir) <= counted:
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            raise AssertionError(f"no new step: rc={proc.returncode}\n{err}")
        time.sleep(0.02)


def kill_during_upload(
    bucket: Bucket, prefix: str, proc, moment: Callable[[Files], bool], after: int
) -> int:
    """Poll the bucket until the checkpoint of a step above ``after`` is part-way up as
    ``moment`` says (or, failing that, the next step's is part-way up at all), then
    SIGKILL the run; returns that step."""
    deadline = time.monotonic() + 180  # only guards against a hang
    while time.monotonic() < deadline:
        for step, files in sorted(partial_steps(bucket, prefix).items()):
            # The moment is a preference: a server that answers one request at a time
            # (the GCS emulator) may never show it, so the next upload does as well.
            if step > after and (moment(files) or (files and step > after + 1)):
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=60)
                assert proc.returncode == -signal.SIGKILL
                return step
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended before it was killed: rc={proc.returncode}\n{err}")
    raise AssertionError("no checkpoint upload seen in time")


def experiment_of(workdir, bucket: Bucket, prefix: str, before: list[str], earlier: set) -> Path:
    """The metrics experiment of a run started with ``before`` complete checkpoints
    there: the checkpoint's own (a resume reports into it), or a new one."""
    if before:
        slug = bucket.json(f"{prefix}/{before[-1]}/experiment.json")["slug"]
        return workdir / "m" / slug
    (new,) = set(experiments(workdir / "m")) - earlier  # a fresh start is a new experiment
    return new


def test_kill_9_during_uploads_then_resume_latest_is_exact(bucket: Bucket, reference: str, workdir):
    prefix = unique_prefix()
    uri = bucket.uri(prefix)
    args = [*RUN, "--checkpoint-dir", uri, "--resume", "latest"]
    cut_off = []
    for name, moment in MOMENTS.items():
        before = bucket.complete_steps(prefix)
        # A step folder cut off by the last kill is rewritten whole, but whether the
        # files seen there are old or new cannot be told: only later steps count.
        seen = max([int(s[5:]) for s in before] + list(partial_steps(bucket, prefix)), default=0)
        counted = losses(workdir)
        earlier = set(experiments(workdir / "m"))
        proc = start_sexpgpu(*args, cwd=workdir, env=bucket.env())
        # The stream is in order: once this run's first loss is there, so is its
        # "resumed from" annotation.
        wait_for_more_losses(workdir, counted, proc)
        step = kill_during_upload(bucket, prefix, proc, moment, seen)
        after = bucket.complete_steps(prefix)
        assert f"step-{STEPS:08d}" not in after, name
        if f"step-{step:08d}" not in after:
            cut_off.append((name, step, sorted(partial_steps(bucket, prefix)[step])))
        # A run killed outright writes nothing more: its status keeps reading "running".
        run_dir = experiment_of(workdir, bucket, prefix, before, earlier)
        assert status(run_dir)["state"] == "running"
        if before:  # it resumed from the newest complete checkpoint there was
            resumed = [
                e["text"] for e in events(run_dir) if e.get("text", "").startswith("resumed")
            ]
            assert resumed[-1].splitlines()[0] == f"resumed from {uri}/{before[-1]}"
    # Killed before experiment.json was written, at least once (the other kills may have
    # landed a moment after the upload finished).
    assert cut_off, "no kill landed during an upload"

    newest = bucket.complete_steps(prefix)[-1]
    done = run_sexpgpu(*args, cwd=workdir, env=bucket.env())
    assert done.returncode == 0, done.stderr
    run_dir = experiment_of(workdir, bucket, prefix, [newest], set())
    texts = [e.get("text", "") for e in events(run_dir)]
    assert [t for t in texts if t.startswith("resumed")][-1].splitlines()[0] == (
        f"resumed from {uri}/{newest}"
    )
    assert status(run_dir)["state"] == "finished"
    assert partial_steps(bucket, prefix) == {}  # every checkpoint cut off was written again
    final = f"step-{STEPS:08d}"
    assert_same_tensors(bucket.tensors(f"{prefix}/{final}"), bucket.tensors(f"{reference}/{final}"))
    # And the checkpoint it resumed from was itself the uninterrupted run's.
    assert_same_tensors(
        bucket.tensors(f"{prefix}/{newest}"), bucket.tensors(f"{reference}/{newest}")
    )
