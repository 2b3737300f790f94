"""The GCS backend against gcp-storage-emulator on loopback: resumable uploads, concurrent
writes, ranged reads, credentials and errors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from sexpgpu.errors import StorageError
from sexpgpu_gcs.backend import GcsStorage
from tests.servers import CountingProxy, free_port, point_gcs_at, unique_prefix


def test_resumable_upload_of_a_large_object(gcs_env, gcs_bucket, monkeypatch):
    # 1 MiB chunks: a 21 MiB object goes up in 21 resumable requests.
    monkeypatch.setenv("SEXPGPU_GCS_CHUNK_SIZE_MB", "1")
    data = np.random.default_rng(3).bytes((21 << 20) + 123)
    store = GcsStorage(f"gs://{gcs_bucket}/{unique_prefix()}")
    store.write_many({"s/params.safetensors": data, "s/states.safetensors": data[::-1]})
    assert store.read("s/params.safetensors") == data
    assert store.read("s/states.safetensors") == data[::-1]
    assert store.identity("s/params.safetensors").size == len(data)
    assert (
        store.read_range("s/params.safetensors", (20 << 20) + 7, 1000)
        == data[(20 << 20) + 7 : (20 << 20) + 1007]
    )


def test_listing_objects_and_prefixes(gcs_env, gcs_bucket):
    # The emulator answers every listing in one page (it ignores maxResults), so paging
    # itself is only exercised against real GCS; see docs/storage.md.
    store = GcsStorage(f"gs://{gcs_bucket}/{unique_prefix()}")
    items = {f"obj-{i:04d}": b"x" for i in range(40)}
    items["step-00000001/state.json"] = b"{}"
    store.write_many(items)
    assert store.list_children() == sorted(items.keys() - {"step-00000001/state.json"}) + [
        "step-00000001"
    ]


def test_no_such_bucket(gcs_env):
    store = GcsStorage("gs://no-such-bucket-here/run")
    for call in (store.check_writable, store.list_children):
        with pytest.raises(StorageError) as info:
            call()
        assert info.value.code == "E-STORAGE-003"
        text = str(info.value)
        assert text.startswith("E-STORAGE-003: no such bucket no-such-bucket-here")
        assert "\n" not in text


def test_no_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS", raising=False)
    # No key file where ADC looks, and no metadata server to fall back on.
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    store = GcsStorage("gs://bucket/run")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    text = str(info.value)
    assert info.value.code == "E-STORAGE-001"
    assert text.startswith("E-STORAGE-001: no GCS credentials for gs://bucket/run")
    assert "\n" not in text
    assert "none found" in store.describe()


def test_checkpoint_key_file_that_is_not_there(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS", str(tmp_path / "ckpt.json"))
    with pytest.raises(StorageError) as info:
        GcsStorage("gs://bucket/run").list_children()
    assert info.value.code == "E-STORAGE-001"
    assert f"the key file {tmp_path / 'ckpt.json'}" in str(info.value)


def test_unreachable_endpoint_fails_after_the_attempts_set(monkeypatch):
    port = free_port()
    point_gcs_at(monkeypatch, f"http://127.0.0.1:{port}")
    monkeypatch.setenv("SEXPGPU_GCS_MAX_ATTEMPTS", "2")
    store = GcsStorage("gs://bucket/run")
    for call, code, doing in (
        (store.list_children, "E-STORAGE-004", "listing gs://bucket/run"),
        (lambda: store.write("x", b"1"), "E-STORAGE-005", "writing gs://bucket/run/x"),
        (lambda: store.read("x"), "E-STORAGE-006", "reading gs://bucket/run/x"),
    ):
        with pytest.raises(StorageError) as info:
            call()
        text = str(info.value)
        assert info.value.code == code
        assert text.startswith(f"{code}: {doing} failed after 2 attempts: "), text
        assert "Connection refused" in text and "\n" not in text
        # the endpoint once, without the client's own objects
        assert text.count("127.0.0.1") == 1 and f"127.0.0.1:{port}: " in text, text
        assert "HTTPConnection" not in text and " at 0x" not in text, text


def test_an_endpoint_whose_name_does_not_resolve_is_named_once(monkeypatch):
    point_gcs_at(monkeypatch, "http://someone:secret@sexpgpu-test.invalid:9")
    monkeypatch.setenv("SEXPGPU_GCS_MAX_ATTEMPTS", "1")
    with pytest.raises(StorageError) as info:
        GcsStorage("gs://bucket/run").list_children()
    text = str(info.value)
    assert info.value.code == "E-STORAGE-004"
    assert text.count("sexpgpu-test.invalid") == 1, text
    assert "Failed to resolve 'sexpgpu-test.invalid'" in text, text
    assert "secret" not in text and "HTTPConnection" not in text, text


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("SEXPGPU_GCS_MAX_ATTEMPTS", "0", "SEXPGPU_GCS_MAX_ATTEMPTS must be at least 1, not 0"),
        ("SEXPGPU_GCS_CONNECT_TIMEOUT", "soon", "SEXPGPU_GCS_CONNECT_TIMEOUT must be an integer"),
        ("SEXPGPU_GCS_READ_TIMEOUT", "0", "SEXPGPU_GCS_READ_TIMEOUT must be at least 1, not 0"),
    ],
)
def test_bad_retry_and_timeout_settings_are_one_line_errors(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(StorageError, match=said):
        GcsStorage("gs://bucket/run")


def test_emulator_endpoint_is_described(gcs_env):
    text = GcsStorage("gs://bucket/run").describe()
    assert text == (
        f"gs://bucket/run (credentials: anonymous (STORAGE_EMULATOR_HOST), endpoint {gcs_env.url})"
    )


def test_reading_headers_transfers_little(gcs_emulator, gcs_bucket, monkeypatch):
    from safetensors.numpy import save

    point_gcs_at(monkeypatch, gcs_emulator.url)
    prefix = unique_prefix()
    blob = save({"model.w": np.ones(5 << 20, dtype=np.float32)})  # 20 MB
    GcsStorage(f"gs://{gcs_bucket}/{prefix}").write("params.safetensors", blob)
    proxy = CountingProxy(gcs_emulator.port).start()
    try:
        point_gcs_at(monkeypatch, proxy.url)
        store = GcsStorage(f"gs://{gcs_bucket}/{prefix}")
        (length,) = struct.unpack("<Q", store.read_range("params.safetensors", 0, 8))
        header = json.loads(store.read_range("params.safetensors", 8, length))
        assert header["model.w"]["shape"] == [5 << 20]
        assert 0 < proxy.downstream < 1 << 20
    finally:
        proxy.stop()


def test_the_client_starts_no_thread_of_its_own(gcs_emulator, gcs_bucket, monkeypatch):
    # google-cloud-storage would otherwise look up the bucket's metadata from a
    # background thread on each call (a request nobody asked for, up to 10 s long)
    import threading

    point_gcs_at(monkeypatch, gcs_emulator.url)
    switch = "DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA"
    monkeypatch.setenv(switch, "")  # recorded, so that what the backend sets is undone
    monkeypatch.delenv(switch)
    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t.name), start(t))[1])
    store = GcsStorage(f"gs://{gcs_bucket}/{unique_prefix()}")
    store.write("a.json", b"{}")
    assert store.read_range("a.json", 0, 2) == b"{}"
    assert started == []
