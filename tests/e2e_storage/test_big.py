"""A checkpoint of more than 100 MB in a bucket: `sexpgpu checkpoint` reads only its
headers (bytes counted on the wire by a forwarder on loopback), and the checkpoint's
`seconds` spans its upload, by the server's own clock."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from tests.e2e.helpers import events, experiments, run_sexpgpu
from tests.e2e_storage.buckets import Bucket, gcs_admin_client, s3_admin_client
from tests.servers import CountingProxy, unique_prefix

pytestmark = pytest.mark.slow


def created(bucket: Bucket, prefix: str) -> dict[str, float]:
    """When each object under ``prefix/`` was stored, in seconds since the epoch, by the
    server (moto keeps whole seconds, the GCS emulator microseconds)."""
    start = prefix + "/"
    if bucket.scheme == "s3":
        listed = s3_admin_client(bucket.endpoint).list_objects_v2(Bucket=bucket.name, Prefix=start)
        stamps: dict[str, datetime] = {o["Key"]: o["LastModified"] for o in listed["Contents"]}
    else:
        blobs = gcs_admin_client(bucket.endpoint).list_blobs(bucket.name, prefix=start)
        stamps = {b.name: b.time_created for b in blobs}
    return {key[len(start) :]: when.timestamp() for key, when in stamps.items()}


def test_a_checkpoint_over_100_mb_is_described_from_its_headers(bucket: Bucket, workdir):
    prefix = unique_prefix()
    done = run_sexpgpu(
        "run", "big.sx", "--metrics-dir", "m", "--checkpoint-dir", bucket.uri(prefix),
        cwd=workdir, env=bucket.env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    step = f"{prefix}/step-00000001"
    sizes = bucket.objects(step)
    assert sum(sizes.values()) >= 100 * 10**6, sizes

    # The checkpoint annotation's seconds cover the upload: the clock started before
    # the first object was stored and stopped after the last (experiment.json).
    (run_dir,) = experiments(workdir / "m")
    (note,) = [e for e in events(run_dir) if e.get("text", "").startswith("checkpoint ")]
    assert note["seconds"] > 0
    stored = created(bucket, step)
    grain = 1.0 if bucket.scheme == "s3" else 0.0  # moto's timestamps are whole seconds
    assert note["time"] - note["seconds"] <= min(stored.values()) + grain
    assert note["time"] + grain >= stored["experiment.json"]

    proxy = CountingProxy(int(bucket.endpoint.rsplit(":", 1)[1])).start()
    try:
        described = run_sexpgpu(
            "checkpoint", bucket.uri(step), cwd=workdir, env=bucket.env(endpoint=proxy.url)
        )
    finally:
        proxy.stop()
    assert (described.returncode, described.stderr) == (0, "")
    assert described.stdout.startswith(f"checkpoint {bucket.uri(step)}\nstep       1\n")
    assert re.search(r"^  model\.big +F32 +\[5120, 5120\] +frozen$", described.stdout, flags=re.M)
    assert proxy.downstream + proxy.upstream < 10**6, (proxy.downstream, proxy.upstream)
    assert proxy.downstream > 0  # it did go through the forwarder
