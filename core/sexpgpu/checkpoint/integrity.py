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
from collections.abc import Callable, Mapping
from typing import Any

import google_crc32c

from sexpgpu.checkpoint.keys import E_CHECKSUM
from sexpgpu.errors import CheckpointError

# A buffer goes to google_crc32c's Python entry point in pieces of this size (a copy
# each) when its C library cannot be called directly.
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


def _extend(crc: int, view: memoryview) -> int:
    """``crc`` (the CRC32C of the bytes before ``view``, 0 for none) extended by ``view``."""
    if not view.nbytes:
        return crc
    if _EXTEND is not None and view.c_contiguous:
        import numpy as np

        # numpy finds the address of any buffer, read-only ones too, without a copy;
        # ``array`` keeps the buffer alive for the call.
        array = np.frombuffer(view, dtype=np.uint8)
        return _EXTEND(crc, array.ctypes.data, array.nbytes)
    for start in range(0, view.nbytes, _CHUNK):
        crc = google_crc32c.extend(crc, view[start : start + _CHUNK].tobytes())
    return crc


def _text(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c(data: bytes | bytearray | memoryview | Any) -> str:
    """The CRC32C of ``data`` (any C-contiguous buffer) as base64 of its 4 big-endian bytes."""
    return _text(_extend(0, memoryview(data).cast("B")))


class Crc32c:
    """The size and CRC32C of a file fed to it piece by piece, in order: a file read in
    chunks is checked without ever being held whole."""

    def __init__(self) -> None:
        self._value = 0
        self.size = 0
        """How many bytes have been fed so far."""

    def update(self, data: bytes | bytearray | memoryview | Any) -> None:
        """Feed the next bytes of the file (any C-contiguous buffer)."""
        view = memoryview(data).cast("B")
        self._value = _extend(self._value, view)
        self.size += view.nbytes

    def text(self) -> str:
        """The CRC32C of the bytes fed so far, as base64 of its 4 big-endian bytes."""
        return _text(self._value)


def file_record(data: bytes | bytearray | memoryview | Any) -> dict[str, Any]:
    """What ``experiment.json`` records of a file: ``{"size": n, "crc32c": "<base64>"}``."""
    view = memoryview(data).cast("B")
    return {"size": view.nbytes, "crc32c": crc32c(view)}


def difference(recorded: Mapping[str, Any], size: int, checksum: str | None) -> str | None:
    """What a file of ``size`` bytes and CRC32C ``checksum`` (``None``: not computed, as
    when the size already differs) has that is not the ``{"size", "crc32c"}`` that
    ``experiment.json`` records, worded to follow ``"<file> is not the file its
    checkpoint wrote: "``; ``None`` when it is the recorded file."""
    if size != recorded["size"]:
        return f"{size} bytes where experiment.json records {recorded['size']}"
    if checksum is not None and checksum != recorded["crc32c"]:
        return f"its CRC32C is {checksum} where experiment.json records {recorded['crc32c']}"
    return None


def not_written(where: str, said: str) -> CheckpointError:
    """``E-CKPT-006`` for the file at ``where``, which differs from its record as
    ``said`` (what :func:`difference` returned)."""
    return CheckpointError(f"{where} is not the file its checkpoint wrote: {said}", code=E_CHECKSUM)


def verify(data: bytes | memoryview, recorded: Mapping[str, Any] | None, where: str) -> None:
    """Nothing when ``data`` has the recorded size and CRC32C (or nothing is recorded, as
    in a checkpoint written before checksums); otherwise ``E-CKPT-006`` naming the file."""
    if recorded is None:
        return
    view = memoryview(data).cast("B")
    # the size is compared first: a file of another size needs no checksum to be refused
    found = crc32c(view) if view.nbytes == recorded["size"] else None
    said = difference(recorded, view.nbytes, found)
    if said is not None:
        raise not_written(where, said)
