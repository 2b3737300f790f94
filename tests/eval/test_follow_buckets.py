"""`evaluate --follow` on s3:// (moto) and gs:// (the emulator), the run writing while
the follower follows, both processes at once."""

from __future__ import annotations

import json

from tests.e2e.helpers import run_sexpgpu, start_sexpgpu
from tests.e2e_storage.buckets import Bucket
from tests.e2e_storage.conftest import (  # noqa: F401
    bucket,
    gcs_bucket_name,
    s3_bucket_name,
)
from tests.servers import gcs_emulator, moto_s3, unique_prefix  # noqa: F401

from .kit import eval_points


def test_the_run_and_its_follower_at_once_on_a_bucket(workdir, bucket: Bucket):  # noqa: F811
    uri = bucket.uri(unique_prefix())
    env = bucket.env()
    follower = start_sexpgpu(
        "evaluate", uri, "--follow", "--poll", "0.2", "--metrics-dir", "m", cwd=workdir, env=env
    )
    try:
        run = run_sexpgpu(
            "run", "eval.sx", "--checkpoint-dir", uri, "--metrics-dir", "m", cwd=workdir, env=env
        )
        assert run.returncode == 0, run.stderr
        out, err = follower.communicate(timeout=300)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    prefix = uri.split("/", 3)[3]
    marked = json.loads(bucket.read(f"{prefix}/evaluated.json"))
    assert marked == {"probe": [2, 4, 6], "final": [6]}
    ran = eval_points(workdir, source=None)
    again = eval_points(workdir, source="evaluate")
    assert len(again) == 16 and all(again[key] == ran[key] for key in again)
