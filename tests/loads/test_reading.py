"""Reading tensors from safetensors files through the storage plugins: headers with
ranged reads, only the tensors named, f16/bf16/f32 into f32, indexes, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file

from sexpgpu.checkpoint.loads import Loads, open_storage, read_header
from sexpgpu.errors import Pos, SexpError, SourceError
from sexpgpu.extension import Storage
from sexpgpu.lang.ir import Init, LoadSpec, ParamDecl, TensorType
from tests.catalogs import open_location

POS = Pos("model.sx", 3, 10)


def decl(path: str, shape: tuple[int, ...], uri: str, tensor: str, dtype: str = "f32"):
    return ParamDecl(
        path, TensorType(shape, dtype), Init("zeros", ()), True, (), LoadSpec(uri, tensor), POS
    )


class Counting(Storage):
    """A storage that counts the bytes each ranged read asks for (and has no
    ``read_range_into``: every tensor is read through ``read_range``)."""

    def __init__(self, inner) -> None:
        self.inner, self.ranges, self.whole = inner, [], 0

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self.ranges.append((start, length))
        return self.inner.read_range(key, start, length)

    def read(self, key: str) -> bytes:
        self.whole += 1
        return self.inner.read(key)

    def identity(self, key: str):
        return self.inner.identity(key)


def test_only_the_header_and_the_named_tensor_are_read(tmp_path: Path) -> None:
    big = np.arange(256 * 1024, dtype=np.float32).reshape(512, 512)
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_file({"big": big, "small": small}, str(tmp_path / "w.safetensors"))
    uri = str(tmp_path / "w.safetensors")
    loads = Loads(open_location=open_location, params=[decl("model.s", (2, 3), uri, "small")])
    loads.check()
    storage, key = open_storage(uri, open_location)
    counting = Counting(storage)
    file = read_header(counting, key, uri)
    loads._files[uri] = file
    values = loads.read()
    np.testing.assert_array_equal(values["model.s"], small)
    assert counting.whole == 0
    read = sum(length for _, length in counting.ranges)
    header = 8 + len(file.header_bytes)
    # the header, the small tensor's 24 bytes, and the header again to see it unchanged
    assert read == header + 24 + len(file.header_bytes)
    assert read < big.nbytes // 100


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_and_single_floats_load_exactly_as_f32(tmp_path: Path, dtype) -> None:
    values = torch.randn(4, 5).to(dtype)
    save_torch_file({"w": values}, str(tmp_path / "w.safetensors"))
    loads = Loads(
        open_location=open_location,
        params=[decl("model.w", (4, 5), str(tmp_path / "w.safetensors"), "w")],
    )
    loads.check()
    got = loads.read()["model.w"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values.to(torch.float32).numpy())


def test_an_integer_tensor_is_refused_with_the_position(tmp_path: Path) -> None:
    save_file({"w": np.zeros((2, 2), np.int64)}, str(tmp_path / "w.safetensors"))
    loads = Loads(
        open_location=open_location,
        params=[decl("model.w", (2, 2), str(tmp_path / "w.safetensors"), "w")],
    )
    with pytest.raises(SourceError) as caught:
        loads.check()
    assert caught.value.render() == (
        f"model.sx:3:10: E-LOAD-004: model.w: w in {tmp_path}/w.safetensors is an integer "
        "I64 tensor, and the f32 parameter takes F32, F16 or BF16"
    )


def test_a_missing_tensor_names_the_nearest(tmp_path: Path) -> None:
    save_file(
        {"encoder.layer.0.query.weight": np.zeros((2, 2), np.float32)},
        str(tmp_path / "w.safetensors"),
    )
    loads = Loads(
        open_location=open_location,
        params=[
            decl("model.q", (2, 2), str(tmp_path / "w.safetensors"), "encoder.layer.0.qery.weight")
        ],
    )
    with pytest.raises(SourceError) as caught:
        loads.check()
    assert caught.value.code == "E-LOAD-003"
    assert caught.value.pos == POS
    assert caught.value.message.endswith("; nearest: encoder.layer.0.query.weight")


def test_a_shape_that_is_not_the_parameters_is_refused(tmp_path: Path) -> None:
    save_file({"w": np.zeros((3, 2), np.float32)}, str(tmp_path / "w.safetensors"))
    loads = Loads(
        open_location=open_location,
        params=[decl("model.w", (2, 3), str(tmp_path / "w.safetensors"), "w")],
    )
    with pytest.raises(SourceError) as caught:
        loads.check()
    assert caught.value.code == "E-LOAD-004"
    assert "has the shape [3 2], the parameter [2 3]" in caught.value.message


def test_an_index_names_the_shard(tmp_path: Path) -> None:
    save_file({"a": np.ones((2,), np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {"b": np.full((3,), 2, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    index = {
        "metadata": {"total_size": 20},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    uri = str(tmp_path / "model.safetensors.index.json")
    loads = Loads(
        open_location=open_location,
        params=[decl("model.a", (2,), uri, "a"), decl("model.b", (3,), uri, "b")],
    )
    loads.check()
    pinned = loads.identities()
    assert pinned["model.b"]["uri"] == str(tmp_path / "model-00002-of-00002.safetensors")
    assert pinned["model.b"]["tensor"] == "b"
    assert pinned["model.b"]["version"].startswith("sha256:")
    values = loads.read()
    np.testing.assert_array_equal(values["model.b"], [2, 2, 2])


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\x05\x00", "is not a safetensors file: it has 2 bytes"),
        (
            (1000).to_bytes(8, "little") + b"{}",
            "is truncated: its header length 1000 goes past the end",
        ),
        ((2**40).to_bytes(8, "little"), "its header length 1099511627776 is past any header"),
        ((4).to_bytes(8, "little") + b"nope", "its header is not JSON"),
        *(
            (len(h).to_bytes(8, "little") + h + bytes(8), "has no dtype, shape and offsets")
            for h in (
                b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}',
                b'{"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}',
                b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}}',
                b'{"w":{"dtype":"F32","shape":[true,2],"data_offsets":[0,8]}}',
                b'{"w":[1,2]}',
            )
        ),
    ],
)
def test_a_file_that_is_not_safetensors_is_one_line(
    tmp_path: Path, content: bytes, said: str
) -> None:
    (tmp_path / "w.safetensors").write_bytes(content)
    loads = Loads(
        open_location=open_location,
        params=[decl("model.w", (2,), str(tmp_path / "w.safetensors"), "w")],
    )
    with pytest.raises(SexpError) as caught:
        loads.check()
    assert caught.value.code == "E-LOAD-002"
    assert caught.value.pos == POS
    assert said in caught.value.message
    assert "\n" not in caught.value.render()


def test_a_truncated_tensor_is_refused_when_read(tmp_path: Path) -> None:
    save_file({"w": np.zeros((64,), np.float32)}, str(tmp_path / "w.safetensors"))
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:-100])
    loads = Loads(
        open_location=open_location,
        params=[decl("model.w", (64,), str(tmp_path / "w.safetensors"), "w")],
    )
    loads.check()
    with pytest.raises(SexpError) as caught:
        loads.read()
    assert caught.value.code == "E-LOAD-002"
    assert "is truncated: w needs 256 bytes" in caught.value.message


def test_a_file_rewritten_while_it_is_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": np.zeros((4,), np.float32)}, str(path))
    loads = Loads(open_location=open_location, params=[decl("model.w", (4,), str(path), "w")])
    loads.check()
    save_file({"w": np.zeros((4,), np.float32), "extra": np.ones((1,), np.float32)}, str(path))
    with pytest.raises(SexpError) as caught:
        loads.read()
    assert caught.value.code == "E-LOAD-005"


def test_a_missing_file_keeps_the_storage_code_and_gets_the_position(tmp_path: Path) -> None:
    loads = Loads(
        open_location=open_location,
        params=[decl("model.w", (4,), str(tmp_path / "gone.safetensors"), "w")],
    )
    with pytest.raises(SexpError) as caught:
        loads.check()
    assert caught.value.code == "E-STORAGE-003"
    assert caught.value.pos == POS
