"""How a run's checkpoint goes up to S3, as the spec has it: the two tensor files as
multipart uploads even when they are small (one part), the JSON files as single PUTs,
and no multipart upload left open behind them. Read back with boto3 from moto."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.helpers import run_sexpgpu
from tests.e2e_storage.buckets import Bucket, s3_admin_client
from tests.servers import unique_prefix

RUN = ["run", "examples/my-run.sx", "--metrics-dir", "m"]  # checkpoints at steps 2 and 4

# A multipart upload's ETag is "<hex>-<parts>"; a single PUT's the MD5 alone.
MULTIPART_ETAG = re.compile(r'^"[0-9a-f]{32}-(\d+)"$')
PUT_ETAG = re.compile(r'^"[0-9a-f]{32}"$')


def test_small_tensor_files_go_up_as_one_part_multipart_uploads(s3: Bucket, workdir: Path):
    prefix = unique_prefix()
    done = run_sexpgpu(*RUN, "--checkpoint-dir", s3.uri(prefix), cwd=workdir, env=s3.env())
    assert done.returncode == 0, done.stderr

    client = s3_admin_client(s3.endpoint)
    for step in ("step-00000002", "step-00000004"):
        for name in ("params.safetensors", "states.safetensors"):
            head = client.head_object(Bucket=s3.name, Key=f"{prefix}/{step}/{name}")
            assert head["ContentLength"] < 8 << 20  # below the part size
            match = MULTIPART_ETAG.match(head["ETag"])
            assert match and match.group(1) == "1", (step, name, head["ETag"])
        for name in ("state.json", "experiment.json"):
            head = client.head_object(Bucket=s3.name, Key=f"{prefix}/{step}/{name}")
            assert PUT_ETAG.match(head["ETag"]), (step, name, head["ETag"])
    open_uploads = client.list_multipart_uploads(Bucket=s3.name, Prefix=f"{prefix}/")
    assert open_uploads.get("Uploads", []) == []
