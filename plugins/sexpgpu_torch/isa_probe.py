"""inductor's check of the CPU's vector instructions, loaded once per machine, not
once per process.

Before inductor loads a compiled CPU kernel it asks which vector instruction sets
(AVX2, AVX-512, VNNI, bf16...) it may use. For each it builds a small probe library
(once: the library stays in inductor's cache folder) and then loads it in a new
Python process, on every start: some 0.25 s a probe and six probes on an AVX-512
machine, about 1.5 s of every start, warm or not, over a quarter of a warm second
start. Whether a given library loads depends only on the library and the Python
and torch that load it, so after a load succeeds :func:`remember_probes` notes it
beside inductor's cache, and a later start that finds the note takes the success
without loading it again. A failed load is never noted: it is tried again on each
start, as inductor would. Which sets inductor picks, and so the code it generates
and the bits it computes, do not change; nor does the key of its cache.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def remember_probes() -> None:
    """Make inductor's probe loads remembered across processes (see the module
    docstring). Idempotent; where torch's probe is not found (another torch
    version), inductor probes as usual."""
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return
    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if not callable(probe) or getattr(probe, "remembered", False):
        return
    cpu_vec_isa.VecISA._probe_load = _remembered(probe, cache_dir)


def _remembered(
    probe: Callable[[object, str], bool], cache_dir: Callable[[], str]
) -> Callable[[object, str], bool]:
    def remembered(isa: object, library: str) -> bool:
        note = _note(Path(cache_dir()), library)
        if note is not None and note.is_file():
            return True
        loaded = probe(isa, library)
        if loaded and note is not None:
            _write_note(note, library)
        return loaded

    remembered.remembered = True  # type: ignore[attr-defined]
    return remembered


def _note(cache: Path, library: str) -> Path | None:
    """The note of a successful load of ``library`` by this Python and torch; None
    where the library cannot be read (the probe then runs as usual)."""
    try:
        stat = os.stat(library)
    except OSError:
        return None
    parts = [torch.__version__, sys.executable, os.path.realpath(library)]
    parts += [str(stat.st_size), str(stat.st_mtime_ns)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    return cache / "sexpgpu" / "isa-probes" / key


def _write_note(note: Path, library: str) -> None:
    """The note, written whole or not at all (its presence is what is read)."""
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        partial = note.with_name(f"{note.name}.{os.getpid()}.tmp")
        partial.write_text(f"{library}\n")
        os.replace(partial, note)
    except OSError:
        pass  # a read-only cache folder: probe again next time
