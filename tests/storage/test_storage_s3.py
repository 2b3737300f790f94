"""The S3 backend against moto's server on loopback: multipart, pagination, credentials,
errors, endpoints, and ranged reads measured through a counting forwarder."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import boto3
import numpy as np
import pytest

from sexpgpu.errors import StorageError
from sexpgpu_s3.backend import S3Storage
from tests.servers import (
    CountingProxy,
    free_port,
    point_s3_at,
    start_iam_moto,
    unique_prefix,
)


def _raw_client(url: str, key: str = "testing", secret: str = "testing"):
    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )


def assert_one_line(error: StorageError, code: str) -> str:
    text = str(error)
    assert error.code == code
    assert text.startswith(f"{code}: ")
    assert "\n" not in text and "Traceback" not in text
    return text


def test_multipart_upload_of_a_large_object(s3_env, s3_bucket):
    data = np.random.default_rng(1).bytes(24 << 20)
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
    store.write("step-00000001/params.safetensors", data)
    identity = store.identity("step-00000001/params.safetensors")
    assert identity.size == len(data)
    # A multipart ETag is "<md5 of part md5s>-<parts>": 8 MiB parts make three.
    assert identity.version.startswith('"') and identity.version.endswith('-3"')
    assert store.read("step-00000001/params.safetensors") == data


def test_a_small_tensor_file_is_a_one_part_multipart_upload(s3_env, s3_bucket):
    # The spec has a checkpoint's tensor files go up as multipart uploads whatever
    # their size; its JSON files as single PUTs.
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
    tensors, record = os.urandom(3000), b'{"step": 1}'
    store.write_many({"s/params.safetensors": tensors, "s/state.json": record})
    assert store.identity("s/params.safetensors").version.endswith('-1"')
    assert store.identity("s/state.json").version == f'"{hashlib.md5(record).hexdigest()}"'
    assert store.read("s/params.safetensors") == tensors


def test_a_failed_one_part_upload_is_aborted(s3_env, s3_bucket):
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")

    def lose_the_part(**_):
        raise ConnectionError("the part was lost")

    store.client.meta.events.register("before-call.s3.UploadPart", lose_the_part)
    with pytest.raises(StorageError) as info:
        store.write_many({"s/params.safetensors": b"x" * 100, "s/state.json": b"{}"})
    text = assert_one_line(info.value, "E-STORAGE-005")
    assert "s/params.safetensors failed: the part was lost" in text
    assert not store.exists("s/params.safetensors")
    assert store.read("s/state.json") == b"{}"  # the other objects are written all the same
    uploads = _raw_client(s3_env.url).list_multipart_uploads(Bucket=s3_bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []  # no part left to be billed


def test_part_size_is_tunable(s3_env, s3_bucket, monkeypatch):
    monkeypatch.setenv("SEXPGPU_S3_PART_SIZE_MB", "5")
    monkeypatch.setenv("SEXPGPU_S3_CONCURRENCY", "3")
    data = np.random.default_rng(2).bytes(21 << 20)
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
    store.write_many({"a/params.safetensors": data, "a/state.json": b"{}"})
    assert store.identity("a/params.safetensors").version.endswith('-5"')
    assert (
        store.read_range("a/params.safetensors", (20 << 20) - 3, 10) == data[-(1 << 20) - 3 :][:10]
    )
    assert store.read("a/params.safetensors") == data


def test_bad_tuning_value_is_a_one_line_error(s3_env, monkeypatch):
    monkeypatch.setenv("SEXPGPU_S3_PART_SIZE_MB", "2")
    with pytest.raises(StorageError, match="SEXPGPU_S3_PART_SIZE_MB must be at least 5"):
        S3Storage("s3://bucket/x")


@pytest.mark.slow
def test_listing_pages_past_1000_children(s3_env, s3_bucket):
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
    items = {f"obj-{i:05d}": b"x" for i in range(1003)}
    items.update({f"step-{i:08d}/state.json": b"{}" for i in range(3)})
    store.write_many(items)
    children = store.list_children()
    assert len(children) == 1006
    assert children[:2] == ["obj-00000", "obj-00001"]
    assert children[-3:] == ["step-00000000", "step-00000001", "step-00000002"]


def test_endpoint_from_aws_endpoint_url(moto_s3, s3_bucket, monkeypatch, tmp_path):
    # boto3 reads AWS_ENDPOINT_URL itself; nothing in the backend passes an endpoint.
    point_s3_at(monkeypatch, moto_s3.url, tmp_path)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.url)
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
    store.check_writable()
    assert f"endpoint {moto_s3.url}" in store.describe()


def test_checkpoint_profile(moto_s3, s3_bucket, monkeypatch, tmp_path):
    point_s3_at(monkeypatch, moto_s3.url, tmp_path, keys=False)
    (tmp_path / "aws-credentials").write_text(
        "[ckpt]\naws_access_key_id = AKIDCKPT\naws_secret_access_key = s3cr3t-value\n"
    )
    monkeypatch.setenv("SEXPGPU_CHECKPOINT_PROFILE", "ckpt")
    store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
    store.check_writable()
    store.write("x", b"1")
    assert store.read("x") == b"1"
    description = store.describe()
    assert "credentials: profile ckpt" in description
    assert "s3cr3t" not in description and "AKIDCKPT" not in description


def test_missing_checkpoint_profile(s3_env, monkeypatch):
    monkeypatch.setenv("SEXPGPU_CHECKPOINT_PROFILE", "nope")
    store = S3Storage("s3://bucket/x")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    text = assert_one_line(info.value, "E-STORAGE-001")
    assert "'nope'" in text and "SEXPGPU_CHECKPOINT_PROFILE" in text


def test_no_credentials(moto_s3, s3_bucket, monkeypatch, tmp_path):
    point_s3_at(monkeypatch, moto_s3.url, tmp_path, keys=False)
    store = S3Storage(f"s3://{s3_bucket}/run")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    text = assert_one_line(info.value, "E-STORAGE-001")
    assert f"s3://{s3_bucket}/run" in text
    with pytest.raises(StorageError) as info:
        store.list_children()
    assert_one_line(info.value, "E-STORAGE-001")
    assert "none found" in store.describe()


def test_no_such_bucket(s3_env):
    store = S3Storage("s3://no-such-bucket-here/run")
    for call in (store.check_writable, store.list_children):
        with pytest.raises(StorageError) as info:
            call()
        text = assert_one_line(info.value, "E-STORAGE-003")
        assert "no such bucket no-such-bucket-here" in text
        assert "credentials: environment" in text
    with pytest.raises(StorageError) as info:
        store.write("x", b"1")
    assert_one_line(info.value, "E-STORAGE-003")


def test_unreachable_endpoint_fails_after_retries(moto_s3, monkeypatch, tmp_path):
    point_s3_at(monkeypatch, f"http://127.0.0.1:{free_port()}", tmp_path)
    monkeypatch.setenv("SEXPGPU_S3_MAX_ATTEMPTS", "2")
    store = S3Storage("s3://bucket/run")
    with pytest.raises(StorageError) as info:
        store.list_children()
    text = assert_one_line(info.value, "E-STORAGE-004")
    assert "after 2 attempts" in text
    with pytest.raises(StorageError) as info:
        store.write("x", b"1")
    assert_one_line(info.value, "E-STORAGE-005")
    with pytest.raises(StorageError) as info:
        store.read("x")
    assert_one_line(info.value, "E-STORAGE-006")


# ------------------------------------------------------------ IAM enforced


@pytest.fixture(scope="module")
def iam_moto(tmp_path_factory):
    """moto enforcing IAM: see tests.servers.start_iam_moto."""
    server, bucket, users = start_iam_moto(tmp_path_factory.mktemp("moto-iam"))
    yield server, bucket, users
    server.stop()


def _as_user(monkeypatch, tmp_path, server, user):
    point_s3_at(monkeypatch, server.url, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", user[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", user[1])


def test_access_denied_writing(iam_moto, monkeypatch, tmp_path):
    server, bucket, users = iam_moto
    _as_user(monkeypatch, tmp_path, server, users["reader"])
    store = S3Storage(f"s3://{bucket}/run")
    assert store.list_children() == []  # listing is allowed
    with pytest.raises(StorageError) as info:
        store.check_writable()
    text = assert_one_line(info.value, "E-STORAGE-002")
    assert f"access denied writing s3://{bucket}/run/" in text
    assert "(credentials: environment)" in text
    assert users["reader"][1] not in text


def test_access_denied_listing(iam_moto, monkeypatch, tmp_path):
    server, bucket, users = iam_moto
    _as_user(monkeypatch, tmp_path, server, users["nobody"])
    store = S3Storage(f"s3://{bucket}/run")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    text = assert_one_line(info.value, "E-STORAGE-002")
    assert f"access denied listing s3://{bucket}/run" in text
    assert users["nobody"][1] not in text


def test_unknown_keys_are_not_accepted(iam_moto, monkeypatch, tmp_path):
    server, bucket, _ = iam_moto
    _as_user(monkeypatch, tmp_path, server, ("AKIAUNKNOWN0000000000", "not-a-real-secret"))
    with pytest.raises(StorageError) as info:
        S3Storage(f"s3://{bucket}/run").list_children()
    text = assert_one_line(info.value, "E-STORAGE-002")
    assert "were not accepted" in text
    assert "not-a-real-secret" not in text


# ------------------------------------------------------------ bytes on the wire


def safetensors_header(store, key: str) -> dict:
    """Read a safetensors file's header with two ranged reads, as `checkpoint` does."""
    (length,) = struct.unpack("<Q", store.read_range(key, 0, 8))
    return json.loads(store.read_range(key, 8, length))


@pytest.mark.slow
def test_reading_headers_of_a_100_mb_object_transfers_under_1_mb(
    moto_s3, s3_bucket, monkeypatch, tmp_path
):
    from safetensors.numpy import save

    point_s3_at(monkeypatch, moto_s3.url, tmp_path)
    prefix = unique_prefix()
    blob = save({"model.w": np.ones(25 << 20, dtype=np.float32)})
    assert len(blob) > 100 * 10**6
    S3Storage(f"s3://{s3_bucket}/{prefix}").write("step-00000001/params.safetensors", blob)

    proxy = CountingProxy(moto_s3.port).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        store = S3Storage(f"s3://{s3_bucket}/{prefix}")
        identity = store.identity("step-00000001/params.safetensors")
        header = safetensors_header(store, "step-00000001/params.safetensors")
        assert identity.size == len(blob)
        assert header["model.w"]["dtype"] == "F32"
        assert 0 < proxy.downstream < 1 << 20
        # The forwarder does count a body: a 2 MB ranged read shows up in full.
        before = proxy.downstream
        store.read_range("step-00000001/params.safetensors", 1000, 2 << 20)
        assert proxy.downstream - before >= 2 << 20
    finally:
        proxy.stop()


def test_counting_proxy_counts_both_ways(s3_env, s3_bucket, monkeypatch):
    proxy = CountingProxy(s3_env.port).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        store = S3Storage(f"s3://{s3_bucket}/{unique_prefix()}")
        store.write("x", os.urandom(300_000))
        assert proxy.upstream >= 300_000
        assert proxy.downstream < 300_000
        proxy.reset()
        store.read("x")
        assert proxy.downstream >= 300_000
        assert proxy.upstream < 300_000
    finally:
        proxy.stop()
