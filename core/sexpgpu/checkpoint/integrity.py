"""Checksums of a checkpoint's files: CRC32C, the checksum S3 and GCS verify on upload.

A checksum is written as S3's ``ChecksumCRC32C`` and GCS's ``crc32c`` are: the
base64 of the four big-endian bytes, so the same text goes to the bucket and into
``experiment.json`` (``"files": {"params.safetensors": {"size": n, "crc32c": "..."}}``).

The ``google-crc32c`` package is hardware accelerated, but its Python entry points
take only ``bytes`` (a copy of a model per checkpoint) and hold the GIL. Its bundled
C library is called through ``ctypes`` instead when it is there: no copy, and the
GIL is released, so the checksum of one file runs while another is being written.
"""

from __future__ import annotations

import base64
import ctypes
import glob
import os
from collections.abc import Callable
from typing import Any

import google_crc32c

from sexpgpu.checkpoint.keys import E_CHECKSUM
from sexpgpu.errors import CheckpointError

# google_crc32c hands a Python buffer over in pieces of this size when ctypes cannot be used.
_CHUNK = 8 << 20


def _native() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` of the library google-crc32c bundles, or None."""
    package = os.path.dirname(os.path.dirname(google_crc32c.__file__))
    for path in sorted(glob.glob(os.path.join(package, "google_crc32c.libs", "libcrc32c*"))):
        try:
            function = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_uint32
        function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return function
    return None


_EXTEND = _native()


def _value(view: memoryview) -> int:
    if not view.nbytes:
        return 0
    if _EXTEND is not None and view.c_contiguous:
        import numpy as np

        # numpy finds the address of any buffer, read-only ones too, without a copy;
        # ``array`` keeps the buffer alive for the call.
        array = np.frombuffer(view, dtype=np.uint8)
        return _EXTEND(0, array.ctypes.data, array.nbytes)
    checksum = google_crc32c.Checksum()
    for start in range(0, view.nbytes, _CHUNK):
        checksum.update(view[start : start + _CHUNK].tobytes())
    return int.from_bytes(checksum.digest(), "big")


def crc32c(data: bytes | bytearray | memoryview | Any) -> str:
    """The CRC32C of ``data`` (any C-contiguous buffer) as base64 of its 4 big-endian bytes."""
    view = memoryview(data).cast("B")
    return base64.b64encode(_value(view).to_bytes(4, "big")).decode("ascii")


def file_record(data: bytes | bytearray | memoryview | Any) -> dict[str, Any]:
    """What ``experiment.json`` records of a file: ``{"size": n, "crc32c": "<base64>"}``."""
    view = memoryview(data).cast("B")
    return {"size": view.nbytes, "crc32c": crc32c(view)}


def verify(data: bytes | memoryview, recorded: dict[str, Any] | None, where: str) -> None:
    """Nothing when ``data`` has the recorded size and CRC32C (or nothing is recorded, as
    in a checkpoint written before checksums); otherwise ``E-CKPT-006`` naming the file."""
    if recorded is None:
        return
    view = memoryview(data).cast("B")
    if view.nbytes != recorded["size"]:
        raise CheckpointError(
            f"{where} is not the file its checkpoint wrote: {view.nbytes} bytes where "
            f"experiment.json records {recorded['size']}",
            code=E_CHECKSUM,
        )
    found = crc32c(view)
    if found != recorded["crc32c"]:
        raise CheckpointError(
            f"{where} is not the file its checkpoint wrote: its CRC32C is {found} where "
            f"experiment.json records {recorded['crc32c']}",
            code=E_CHECKSUM,
        )
