"""The Storage protocol, method by method, on all three backends against real servers."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from sexpgpu.errors import StorageError
from sexpgpu.extension import ObjectIdentity


def test_uri_is_normalised_without_trailing_slash(location):
    from tests.catalogs import open_location

    store = open_location(location + "/")
    assert store.uri == location
    assert not store.uri.endswith("/")


def test_describe_is_one_line_naming_the_location(store, location):
    text = store.describe()
    assert "\n" not in text
    tail = location.rsplit("/", 1)[-1]
    assert tail in text


def test_empty_location_has_no_children(store):
    assert store.list_children() == []
    assert store.list_children("step-00000001") == []


def test_check_writable_leaves_nothing_behind(store):
    store.check_writable()
    assert store.list_children() == []


def test_write_read_exists(store):
    assert not store.exists("step-00000001/state.json")
    store.write("step-00000001/state.json", b'{"step": 1}')
    assert store.exists("step-00000001/state.json")
    assert store.read("step-00000001/state.json") == b'{"step": 1}'
    assert not store.exists("step-00000001")  # a folder is not an object


def test_write_overwrites(store):
    store.write("a.json", b"first version")
    store.write("a.json", b"second")
    assert store.read("a.json") == b"second"


def test_write_takes_a_memoryview_of_an_array(store):
    array = np.arange(1000, dtype=np.float32)
    store.write("t.bin", memoryview(array))
    assert store.read("t.bin") == array.tobytes()


def test_empty_object(store):
    store.write("empty", b"")
    assert store.exists("empty")
    assert store.read("empty") == b""
    assert store.identity("empty").size == 0


def test_list_children_one_level(store):
    store.write_many(
        {
            "step-00000002/params.safetensors": b"p",
            "step-00000002/sub/deeper.json": b"d",
            "step-00000004/experiment.json": b"e",
            "evaluated.json": b"{}",
        }
    )
    assert store.list_children() == ["evaluated.json", "step-00000002", "step-00000004"]
    assert store.list_children("step-00000002") == ["params.safetensors", "sub"]
    assert store.list_children("step-00000002/") == ["params.safetensors", "sub"]
    assert store.list_children("step-00000003") == []


def test_read_range(store):
    data = bytes(range(256)) * 40
    store.write("blob", data)
    assert store.read_range("blob", 0, 8) == data[:8]
    assert store.read_range("blob", 1000, 517) == data[1000:1517]
    assert store.read_range("blob", len(data) - 5, 100) == data[-5:]
    assert store.read_range("blob", len(data) + 10, 4) == b""
    assert store.read_range("blob", 3, 0) == b""


def test_read_missing_is_a_one_line_error(store):
    with pytest.raises(StorageError) as info:
        store.read("step-00000009/state.json")
    assert info.value.code == "E-STORAGE-003"
    assert "step-00000009/state.json" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(StorageError) as info:
        store.identity("nothing-here")
    assert info.value.code == "E-STORAGE-003"


def test_delete(store):
    store.write("step-00000001/a", b"1")
    store.write("step-00000001/b", b"2")
    store.delete("step-00000001/a")
    assert not store.exists("step-00000001/a")
    assert store.list_children("step-00000001") == ["b"]
    store.delete("step-00000001/a")  # gone already: no error
    store.delete("step-00000001/b")
    assert store.list_children() == []  # no empty folder left behind, on any backend


def test_write_many(store):
    rng = np.random.default_rng(0)
    items = {f"step-00000001/part-{i}": rng.bytes(1000 + i) for i in range(12)}
    items["step-00000001/big"] = rng.bytes(3 << 20)
    store.write_many(items)
    assert store.list_children("step-00000001") == sorted(k.split("/")[1] for k in items)
    for key, data in items.items():
        assert store.read(key) == data


def test_identity(store, location):
    data = os.urandom(5000)
    store.write("f", data)
    first = store.identity("f")
    assert isinstance(first, ObjectIdentity)
    assert first.size == 5000
    assert store.identity("f") == first  # stable while the object is unchanged
    if location.startswith("s3://"):
        # A single PUT's ETag is the MD5 of the bytes, quoted as S3 sends it.
        assert first.version == f'"{hashlib.md5(data).hexdigest()}"'
    elif location.startswith("gs://"):
        assert first.version.startswith("generation:")
        assert int(first.version.split(":", 1)[1]) > 0
    else:
        assert first.version == f"sha256:{hashlib.sha256(data).hexdigest()}"
    store.write("f", data[:-1] + bytes([data[-1] ^ 1]))
    second = store.identity("f")
    assert second.size == 5000
    assert second.version != first.version


def test_an_object_needs_a_name(store):
    with pytest.raises(StorageError, match="without a name"):
        store.write("", b"x")
    with pytest.raises(StorageError, match="without a name"):
        store.write_many({"a": b"1", "/": b"2"})
