"""What the steps freed and glibc's malloc kept goes back to the system before a
fully sharded checkpoint's host copies are made (``sexpgpu_torch.host_memory``)."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter: a 4 MB block freed raises glibc's mmap threshold, so the
# next 1 MB blocks come from the heap; a block kept after them stops the heap's top
# from shrinking when they are freed. Their 200 MB then stays resident until trimmed.
FRAGMENTED = """
import os
from sexpgpu_torch.host_memory import give_back_freed

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

big = bytearray(4 << 20)
del big
blocks = [bytearray(b"x" * (1 << 20)) for _ in range(200)]
kept = bytearray(b"y" * (1 << 20))
del blocks
before = resident_mb()
assert give_back_freed()
print(before - resident_mb())
"""


def test_memory_freed_but_kept_by_malloc_goes_back_to_the_system():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, check=True
    )
    assert float(out.stdout) > 150, out.stdout
