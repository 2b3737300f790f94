"""The CRC32C of each object goes to the service with the upload, so the service can
verify it: what S3 receives (moto 5.2 neither stores nor verifies it on a PUT, so the
request itself is checked) and what the GCS emulator verifies (resumable uploads)."""

from __future__ import annotations

import base64
import os

import google_crc32c
import pytest

from sexpgpu.errors import StorageError
from tests.catalogs import open_location
from tests.servers import unique_prefix

SMALL = b"a small object\n" * 10
LARGE = os.urandom(20 << 20)  # above the part size and the resumable threshold


def _crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def test_s3_sends_the_crc32c_of_every_object_and_part(s3_env, s3_bucket):
    storage = open_location(f"s3://{s3_bucket}/{unique_prefix()}")
    sent: list[tuple[str, dict]] = []
    storage.client.meta.events.register(
        "before-send.s3.*",
        lambda request, **_: sent.append((request.method, dict(request.headers))),
    )
    storage.write_many(
        {"small": SMALL, "large": LARGE}, crc32c={"small": _crc(SMALL), "large": _crc(LARGE)}
    )
    assert storage.read("small") == SMALL and storage.read("large") == LARGE

    checksums = [_text(h.get("x-amz-checksum-crc32c")) for _, h in sent]
    assert _crc(SMALL) in checksums  # the PUT
    assert checksums.count(_crc(LARGE)) == 1  # CompleteMultipartUpload: the full object
    part = storage.part_size
    for start in range(0, len(LARGE), part):  # each part's own
        assert _crc(LARGE[start : start + part]) in checksums


def test_s3_sends_the_crc32c_of_a_small_tensor_file_with_its_one_part(s3_env, s3_bucket):
    storage = open_location(f"s3://{s3_bucket}/{unique_prefix()}")
    sent: list[tuple[str, str | None]] = []
    storage.client.meta.events.register(
        "before-parameter-build.s3.*",
        lambda model, params, **_: sent.append((model.name, params.get("ChecksumCRC32C"))),
    )
    key = "step-00000001/params.safetensors"
    storage.write_many({key: SMALL}, crc32c={key: _crc(SMALL)})
    assert storage.read(key) == SMALL
    assert [name for name, _ in sent][:3] == [
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
    ]
    assert sent[1][1] == sent[2][1] == _crc(SMALL)  # the part's, then the whole object's


def test_s3_without_checksums_uploads_as_before(s3_env, s3_bucket):
    storage = open_location(f"s3://{s3_bucket}/{unique_prefix()}")
    storage.write_many({"large": LARGE, "small": SMALL})
    assert storage.read("large") == LARGE and storage.read("small") == SMALL


def test_gcs_verifies_the_crc32c_it_is_handed(gcs_env, gcs_bucket):
    storage = open_location(f"gs://{gcs_bucket}/{unique_prefix()}")
    storage.write_many(
        {"small": SMALL, "large": LARGE}, crc32c={"small": _crc(SMALL), "large": _crc(LARGE)}
    )
    bucket = storage.client.bucket(storage.bucket_name)
    for key, data in (("small", SMALL), ("large", LARGE)):
        assert bucket.get_blob(storage._name(key)).crc32c == _crc(data)
    with pytest.raises(StorageError) as caught:
        storage.write_many({"forged": LARGE}, crc32c={"forged": _crc(b"other bytes")})
    assert caught.value.code == "E-STORAGE-005"
    assert "CRC32C" in caught.value.message
    assert not storage.exists("forged")
