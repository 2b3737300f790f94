"""The bucket goes away in the middle of a run: the checkpoint write that fails for good
fails the run cleanly (status `failed`, exit 1, one line) and the last good checkpoint is
intact: a `--resume latest` against the bucket finishes from it."""

from __future__ import annotations

import time

import pytest

from tests.e2e.helpers import events, experiments, run_sexpgpu, start_sexpgpu, status
from tests.e2e_storage.buckets import CHECKPOINT_FILES, Bucket, said
from tests.servers import CountingProxy, unique_prefix

pytestmark = pytest.mark.slow

STEPS = 12
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


def test_a_checkpoint_write_that_fails_for_good_fails_the_run(s3: Bucket, workdir):
    prefix = unique_prefix()
    uri = s3.uri(prefix)
    # The run reaches moto through a forwarder; closing the forwarder is the bucket's
    # endpoint going away for good (every retry refused), while the test still sees
    # moto directly.
    proxy = CountingProxy(int(s3.endpoint.rsplit(":", 1)[1])).start()
    env = s3.env(endpoint=proxy.url, SEXPGPU_S3_MAX_ATTEMPTS="2")
    proc = start_sexpgpu(*RUN, "--checkpoint-dir", uri, cwd=workdir, env=env)
    try:
        deadline = time.monotonic() + 180  # only guards against a hang
        while "step-00000002" not in s3.complete_steps(prefix):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint of step 2"
            time.sleep(0.02)
    finally:
        proxy.stop()
    out, err = proc.communicate(timeout=300)

    assert proc.returncode == 1, err
    (line,) = said(err)
    good = s3.complete_steps(prefix)[-1]
    failed_at = int(good[5:]) + 1
    assert failed_at < STEPS
    # the checkpoint that could not be written names its step, as a failed step does
    assert line.startswith(f"sexpgpu run: step {failed_at}: E-STORAGE-005: "), line
    assert uri in line
    (run_dir,) = experiments(workdir / "m")
    st = status(run_dir)
    assert st["state"] == "failed"
    assert st["error"] == line.removeprefix("sexpgpu run: ")
    assert st["checkpoint"] == f"{uri}/{good}"
    stream = events(run_dir)
    assert f"failed: {st['error']}" in [e.get("text") for e in stream]
    assert all(e["kind"] != "done" for e in stream)

    # The last good checkpoint is whole, and the run continues from it.
    assert set(s3.objects(f"{prefix}/{good}")) == set(CHECKPOINT_FILES)
    resumed = run_sexpgpu(
        *RUN, "--checkpoint-dir", uri, "--resume", "latest", cwd=workdir, env=s3.env()
    )
    assert resumed.returncode == 0, resumed.stderr
    texts = [e.get("text", "") for e in events(run_dir)]
    assert [t for t in texts if t.startswith("resumed")][-1].splitlines()[0] == (
        f"resumed from {uri}/{good}"
    )
    assert status(run_dir)["state"] == "finished"
    assert s3.complete_steps(prefix)[-1] == f"step-{STEPS:08d}"
