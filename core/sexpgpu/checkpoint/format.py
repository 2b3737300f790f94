"""The safetensors format of a checkpoint's tensor files: laying tensors out,
encoding them with a single copy of the data (none for arrays already laid out),
and checking a header and a file's size before anything is decoded.

Torch-free: numpy is imported when a tensor is first encoded or decoded, and
nothing is ever unpickled (the format is a JSON header and raw bytes).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.keys import damaged, is_count
from sexpgpu.errors import CheckpointError

if TYPE_CHECKING:
    import numpy as np

# safetensors refuses headers above 100 MB; a larger length is damage, not a header.
_MAX_HEADER = 100_000_000

# safetensors dtype name -> numpy dtype string, for the dtypes a checkpoint may hold.
_ST_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "|i1",
    "U8": "|u1",
    "BOOL": "|b1",
}
_NP_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64"}
_NP_TO_ST.update({"int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"})


def _layout(specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple[bytes, dict[str, int]]:
    """A safetensors file's first bytes (length and header) and each tensor's offset in
    the file, for tensors given as name -> (shape, numpy dtype).

    Tensors are ordered as ``safetensors`` orders them (element size, largest first,
    then name) and the header is padded with spaces to 8 bytes, so the file is
    byte for byte the one ``safetensors.numpy.save`` makes.
    """
    order = sorted(specs, key=lambda name: (-specs[name][1].itemsize, name))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        shape, dtype = specs[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NP_TO_ST[dtype.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {name: len(prefix) + header[name]["data_offsets"][0] for name in order}


def _specs(tensors: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    import numpy as np

    specs = {}
    for name, (shape, dtype) in tensors.items():
        dtype = np.dtype(dtype)
        if dtype.name not in _NP_TO_ST:
            raise CheckpointError(f"{name}: cannot store a {dtype} tensor in a checkpoint")
        specs[name] = (tuple(int(n) for n in shape), dtype.newbyteorder("<"))
    return specs


def layout_tensors(specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
    """Zeroed, writable arrays, one per tensor of ``specs`` (name -> (shape, dtype)),
    that already lie in one buffer as the safetensors file of those tensors.

    A lowering's ``export`` copies its tensors from the device into these arrays
    instead of into arrays of its own, saving a copy of the model per checkpoint.
    The contract it relies on:

    - each array is C-contiguous, little-endian, zero-filled and writable, with
      exactly the shape and dtype asked; a dtype a checkpoint cannot hold (any
      but float64/32/16, int64/32/16/8, uint8, bool) raises
      :class:`sexpgpu.errors.CheckpointError` naming the tensor;
    - it is written in place (``out[name][...] = values``), never replaced, and the
      whole mapping, the same names and no others, is handed to
      :func:`encode_safetensors` (or ``write_checkpoint``): that buffer is then
      stored as it is, without copying a byte;
    - whatever is handed over instead (a replaced array, some of the names, arrays
      of its own) is still stored, with one copy: the file's bytes are those
      ``safetensors.numpy.save`` makes for the same arrays either way, so the
      checkpoint does not depend on whether the export used this helper.
    """
    import numpy as np

    specs = _specs(specs)
    prefix, offsets = _layout(specs)
    size = len(prefix) + sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    # np.zeros maps fresh zero pages lazily; bytearray(size) would write every byte.
    view = np.zeros(size, dtype=np.uint8)
    view[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    out = {}
    for name, (shape, dtype) in specs.items():
        begin = offsets[name]
        nbytes = math.prod(shape) * dtype.itemsize
        out[name] = view[begin : begin + nbytes].view(dtype).reshape(shape)
    return out


def _laid_out(arrays: Mapping[str, np.ndarray], prefix: bytes, offsets: Mapping[str, int]):
    """The buffer ``arrays`` already lie in as this very file (see :func:`layout_tensors`),
    or ``None`` when they do not."""
    import numpy as np

    root: Any = next((a for a in arrays.values() if a.nbytes), None)
    if root is None:
        return None
    while isinstance(root.base, np.ndarray):  # numpy points a view at the array owning it
        root = root.base
    if root.base is not None or root.dtype != np.uint8 or root.ndim != 1:
        return None
    size = len(prefix) + sum(a.nbytes for a in arrays.values())
    if len(root) != size or bytes(root[: len(prefix)]) != prefix:
        return None
    address = root.ctypes.data
    for name, array in arrays.items():
        if array.nbytes and (
            array.ctypes.data != address + offsets[name] or not array.flags.c_contiguous
        ):
            return None
    return root


def encode_safetensors(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """``tensors`` in the safetensors format, with at most one copy of the data.

    The bytes are those ``safetensors.numpy.save`` makes for the same arrays, so
    any safetensors reader loads them; ``save`` copies every tensor twice, which
    a checkpoint of a large model feels. Arrays made by :func:`layout_tensors`
    are not copied at all: their buffer is returned as it is. Returns the file's
    bytes as a 1-D ``uint8`` array (a buffer: ``memoryview`` or ``bytes`` of it).
    """
    import numpy as np

    arrays = {}
    for name, value in tensors.items():
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        arrays[name] = array
    specs = _specs({name: (a.shape, a.dtype) for name, a in arrays.items()})
    prefix, offsets = _layout(specs)
    ready = _laid_out(arrays, prefix, offsets)
    if ready is not None:
        return ready
    # np.empty leaves the pages untouched until the copy writes them; bytearray(n)
    # would first write zeros over all of them, doubling the memory traffic.
    out = np.empty(len(prefix) + sum(a.nbytes for a in arrays.values()), dtype=np.uint8)
    out[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    view = out
    for name, array in arrays.items():
        if array.nbytes:
            # copyto through a view of the destination: one memcpy per tensor.
            begin = offsets[name]
            target = view[begin : begin + array.nbytes].view(specs[name][1]).reshape(array.shape)
            np.copyto(target, array, casting="no")
    return out


def header_length(head: bytes, where: str, size: int | None) -> int:
    """The header length in a file's first 8 bytes, checked against the file's size."""
    if len(head) < 8:
        raise damaged(where, f"{len(head)} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", bytes(head[:8]))
    limit = _MAX_HEADER if size is None else min(size - 8, _MAX_HEADER)
    if length > limit:
        raise damaged(where, f"its header length {length} goes beyond the file")
    return length


def parse_header(raw: bytes, where: str) -> tuple[dict[str, Any], int]:
    """Check and decode a safetensors header (the JSON after the 8-byte length).

    Returns (the header without ``__metadata__``, the bytes of tensor data it
    describes). Every tensor must have a known dtype, a shape, and offsets that
    hold exactly its bytes, one after the other from 0, as the format requires;
    anything else raises :class:`CheckpointError`.
    """
    from sexpgpu.checkpoint.schema import load_json

    header = load_json(raw, where, lambda at, _: damaged(at, "its header is not JSON (truncated?)"))
    if not isinstance(header, dict):
        raise damaged(where, "its header is not a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        if not (
            isinstance(entry, dict)
            and entry.get("dtype") in _ST_DTYPES
            and isinstance(entry.get("shape"), list)
            and all(is_count(n) for n in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(is_count(n) for n in entry["data_offsets"])
        ):
            raise damaged(where, f"the header entry of {name!r} is not a readable tensor")
        begin, end = entry["data_offsets"]
        itemsize = int(_ST_DTYPES[entry["dtype"]][2:])
        if end - begin != math.prod(entry["shape"]) * itemsize:
            raise damaged(where, f"{name!r} does not have the bytes its shape needs")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise damaged(where, f"the data of {name!r} does not follow the tensor before it")
        position = end
    return header, position


def _size_mismatch(where: str, need: int, have: int) -> CheckpointError:
    if have < need:
        return damaged(
            where, f"its tensors need {need} bytes of data and it holds {have} (truncated)"
        )
    return damaged(where, f"it has {have - need} bytes after its tensors")


def decode_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, checked by :func:`parse_header` first, as
    writable numpy arrays. Never unpickles: the format is a JSON header and raw bytes."""

    length = header_length(data[:8], where, len(data))
    header, need = parse_header(data[8 : 8 + length], where)
    start = 8 + length
    if len(data) - start != need:
        raise _size_mismatch(where, need, len(data) - start)
    from safetensors.numpy import load

    try:
        return load(bytes(data))
    except Exception as exc:  # the checks above should have caught it; say so plainly
        raise damaged(where, f"safetensors cannot read it: {exc}") from None
