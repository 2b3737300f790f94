"""Checksums end to end on s3:// and gs://: each file's CRC32C in experiment.json is
the one of the object the bucket holds, a byte changed in the bucket is refused by a
resume naming the object, and credentials in an endpoint URL never reach a message."""

from __future__ import annotations

import base64
from pathlib import Path

import google_crc32c

from tests.e2e.helpers import refused_in_process, run_sexpgpu
from tests.e2e_storage.buckets import Bucket, gcs_admin_client, s3_admin_client, said
from tests.servers import free_port, unique_prefix

RUN = ["run", "examples/my-run.sx", "--metrics-dir", "m"]


def _crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def _put(bucket: Bucket, key: str, data: bytes) -> None:
    if bucket.scheme == "s3":
        s3_admin_client(bucket.endpoint).put_object(Bucket=bucket.name, Key=key, Body=data)
    else:
        gcs_admin_client(bucket.endpoint).bucket(bucket.name).blob(key).upload_from_string(data)


def test_a_byte_changed_in_the_bucket_is_refused_by_a_resume(bucket: Bucket, workdir: Path):
    prefix = unique_prefix()
    location = bucket.uri(prefix)
    env = bucket.env()
    done = run_sexpgpu(*RUN, "--checkpoint-dir", location, "--steps", "4", cwd=workdir, env=env)
    assert done.returncode == 0, done.stderr

    step4 = f"{prefix}/step-00000004"
    files = bucket.json(f"{step4}/experiment.json")["files"]
    for name, record in files.items():
        data = bucket.read(f"{step4}/{name}")
        assert record == {"size": len(data), "crc32c": _crc(data)}, name

    data = bytearray(bucket.read(f"{step4}/params.safetensors"))
    data[-3] ^= 0x10
    _put(bucket, f"{step4}/params.safetensors", bytes(data))
    resume = [*RUN, "--checkpoint-dir", location, "--steps", "6", "--resume"]
    for value, hint in (
        ("latest", f"to resume from the one before it, pass --resume {location}/step-00000002"),
        (f"{location}/step-00000004", None),
    ):
        done = run_sexpgpu(*resume, value, cwd=workdir, env=env)
        assert done.returncode == 1, done.stderr
        (line,) = said(done.stderr)
        assert line.startswith(
            f"sexpgpu run: E-CKPT-006: {location}/step-00000004/params.safetensors is not the "
            "file its checkpoint wrote: its CRC32C is"
        ), line
        assert hint is None or line.endswith(hint), line
    assert bucket.complete_steps(prefix) == ["step-00000002", "step-00000004"]


def test_credentials_in_the_endpoint_url_are_not_echoed(s3: Bucket, workdir: Path):
    endpoint = f"http://someone:hunter2secret@127.0.0.1:{free_port()}"
    env = s3.env(endpoint=endpoint, SEXPGPU_S3_MAX_ATTEMPTS="1")
    done = refused_in_process(
        *RUN, "--checkpoint-dir", s3.uri(unique_prefix()), cwd=workdir, env=env, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert "hunter2secret" not in done.stderr + done.stdout
    (line,) = said(done.stderr)
    assert line.startswith("sexpgpu run: E-STORAGE-004: "), line
    assert "http://***@127.0.0.1:" in line, line
