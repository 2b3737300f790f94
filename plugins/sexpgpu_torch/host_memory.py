"""Handing back to the system the host memory the process has freed.

glibc's malloc keeps much of what is freed for the next allocations rather than
returning it: under ``:shard full`` every step gathers each unit's parameters
whole and frees them, and those blocks stay in the resident set. A checkpoint
then lays its host copies on top of them, at the run's peak. Trimming the heap
first (``malloc_trim(0)``, lost in the noise of a checkpoint's gathers) takes
that peak from 0.69 of one rank's memory to 0.49 as glibc comes (0.59 counting
only what tensors hold; ``benchmarks/bench_shard_memory.py``). Where the C
library has no ``malloc_trim`` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        # the symbols the process has loaded, the C library's among them (finding it by
        # name would fork ``ldconfig -p`` from a process that holds torch)
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_freed() -> bool:
    """Return the freed memory glibc's malloc keeps to the system; whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
