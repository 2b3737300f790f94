""":load from s3:// and gs:// (moto's S3 server and the GCS emulator on loopback): the
pinned version (the ETag, the generation), bit-exact resume, E-LOAD-001 with an
ETag, and only the named tensors crossing the wire."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.e2e.helpers import assert_same_tensors
from tests.e2e_storage.buckets import Bucket, gcs_admin_client, s3_admin_client
from tests.servers import CountingProxy, start_iam_moto, unique_prefix

from .helpers import experiment, run_sexpgpu, said, teacher_tensors, write_project

pytestmark = pytest.mark.slow


def upload(bucket: Bucket, key: str, path: Path) -> str:
    """Store ``path`` at ``key``; returns the version a run must pin for it."""
    if bucket.scheme == "s3":
        client = s3_admin_client(bucket.endpoint)
        client.put_object(Bucket=bucket.name, Key=key, Body=path.read_bytes())
        return client.head_object(Bucket=bucket.name, Key=key)["ETag"]
    blob = gcs_admin_client(bucket.endpoint).bucket(bucket.name).blob(key)
    blob.upload_from_filename(str(path))
    blob.reload()
    return f"generation:{blob.generation}"


def bucket_project(bucket: Bucket, folder: Path) -> tuple[str, str]:
    """A project whose teacher is read from the bucket; returns (its URI, its version)."""
    key = f"{unique_prefix()}/weights/teacher.safetensors"
    write_project(folder, teacher_uri=bucket.uri(key))
    version = upload(bucket, key, folder / "teacher.safetensors")
    (folder / "teacher.safetensors").unlink()  # only the bucket's copy is there to read
    return bucket.uri(key), version


def test_a_bucket_file_is_pinned_and_a_resume_is_byte_identical(
    bucket: Bucket, tmp_path: Path
) -> None:
    uri, version = bucket_project(bucket, tmp_path)
    env = bucket.env()
    whole = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "whole", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr
    pinned = {
        p["path"]: p.get("load") for p in experiment(tmp_path / "whole" / "step-00000004")["params"]
    }
    size = len(bucket.read(uri.split("/", 3)[3]))
    assert pinned["teacher.embed"] == {
        "uri": uri,
        "tensor": "teacher.embed.weight",
        "size": size,
        "version": version,
    }
    if bucket.scheme == "s3":
        assert version.startswith('"') and version.endswith('"')  # the ETag as S3 sends it
    else:
        assert version.startswith("generation:")
    shown = run_sexpgpu("checkpoint", "whole/step-00000004", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"  teacher.embed  teacher.embed.weight in {uri}, {size} bytes, {version}\n" in (
        shown.stdout
    )
    half = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "half", "--steps", "2", cwd=tmp_path, env=env
    )
    assert half.returncode == 0, half.stderr
    resumed = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "half", "--resume", "latest", cwd=tmp_path, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_tensors(tmp_path / "whole" / "step-00000004", tmp_path / "half" / "step-00000004")


def test_another_etag_is_refused_with_e_load_001(s3: Bucket, tmp_path: Path) -> None:
    uri, old = bucket_project(s3, tmp_path)
    env = s3.env()
    first = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "ckpt", "--steps", "2", cwd=tmp_path, env=env
    )
    assert first.returncode == 0, first.stderr
    other = tmp_path / "other.safetensors"
    save_file(teacher_tensors(seed=9), str(other))
    new = upload(s3, uri.split("/", 3)[3], other)
    size = other.stat().st_size
    done = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "ckpt", "--resume", "latest", cwd=tmp_path, env=env
    )
    assert done.returncode == 1
    assert said(done.stderr) == [
        "sexpgpu run: E-LOAD-001: a loaded parameter's file is not the one the checkpoint's run read:",
        *(
            f"  teacher.{name}: teacher.{name}.weight in {uri}, {size} bytes, {old}"
            f" -> teacher.{name}.weight in {uri}, {size} bytes, {new}"
            for name in ("embed", "head")
        ),
        "restore that file, or start the run again",
    ]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000001",
        "step-00000002",
    ]


def test_only_the_named_tensors_are_transferred(bucket: Bucket, tmp_path: Path) -> None:
    # A teacher file with 4 MB more than the program uses: only headers and the two
    # small tensors the program names come over the wire.
    key = f"{unique_prefix()}/teacher.safetensors"
    write_project(tmp_path, teacher_uri=bucket.uri(key))
    tensors = {**teacher_tensors(), "unused.weight": np.ones((1024, 1024), np.float32)}
    save_file(tensors, str(tmp_path / "teacher.safetensors"))
    upload(bucket, key, tmp_path / "teacher.safetensors")
    proxy = CountingProxy(int(bucket.endpoint.rsplit(":", 1)[1])).start()
    try:
        done = run_sexpgpu(
            "run", "loads.sx", "--steps", "1", cwd=tmp_path, env=bucket.env(endpoint=proxy.url)
        )
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    assert 2048 < proxy.downstream < 200_000, proxy.downstream


def test_an_object_that_is_not_there_is_one_line_with_the_position(
    bucket: Bucket, tmp_path: Path
) -> None:
    write_project(tmp_path, teacher_uri=bucket.uri(f"{unique_prefix()}/gone.safetensors"))
    done = run_sexpgpu("check", "loads.sx", cwd=tmp_path, env=bucket.env())
    assert done.returncode == 1
    (line,) = said(done.stderr)
    assert line.removeprefix("sexpgpu check: ").startswith("loads.sx:7:10: E-STORAGE-")


def test_an_object_the_credentials_may_not_read_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "moto-iam").mkdir()
    server, name, users = start_iam_moto(tmp_path / "moto-iam")
    try:
        key, secret = users["nobody"]
        home = tmp_path / "home"
        home.mkdir()
        bucket = Bucket("s3", name, server.url, home, key, secret)
        write_project(tmp_path, teacher_uri=bucket.uri("weights/teacher.safetensors"))
        env = bucket.env(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
        done = run_sexpgpu("run", "loads.sx", "--checkpoint-dir", "ckpt", cwd=tmp_path, env=env)
    finally:
        server.stop()
    assert done.returncode == 1
    (line,) = said(done.stderr)
    assert line.startswith("sexpgpu run: loads.sx:7:10: E-STORAGE-002: access denied")
    assert secret not in done.stderr
    assert not (tmp_path / "ckpt").exists()  # a refused run leaves no folder behind
