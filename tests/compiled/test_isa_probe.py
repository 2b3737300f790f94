"""inductor's probe of the CPU's vector instructions runs once per machine and cache
folder, not once per start (``sexpgpu_torch.isa_probe``).

A start is a new Python process (inductor keeps the probe's result for the life of
a process) on the suite's compile caches, counting the probe libraries it loads in a
subprocess; the memo itself is tested in-process on stand-in probes.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sexpgpu_torch.isa_probe import _remembered
from tests.e2e.helpers import sexpgpu_env

PROBE = """
import json, sys
from torch._inductor import cpu_vec_isa

loads = []
real = cpu_vec_isa.VecISA._probe_load
failing = sys.argv[1]

def counted(self, path):
    loads.append(str(self))
    return False if str(self) == failing else real(self, path)

cpu_vec_isa.VecISA._probe_load = counted
from sexpgpu_torch.isa_probe import remember_probes

remember_probes()
remember_probes()  # twice: idempotent
picked = cpu_vec_isa.pick_vec_isa()
print(json.dumps({"loads": loads, "picked": str(picked),
                  "valid": [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()],
                  "flags": picked.build_arch_flags()}))
"""

X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


def _start(cache: Path, failing: str = "") -> dict:
    """One process's probe: which sets it loaded a probe library for, what it picked."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, failing],
        env=sexpgpu_env(TORCHINDUCTOR_CACHE_DIR=str(cache)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_no_probe_and_picks_the_same(torch_compile_cache: Path) -> None:
    first = _start(torch_compile_cache)  # builds and loads the probes if the suite has not
    second = _start(torch_compile_cache)
    assert second["loads"] == []
    picked = ("picked", "valid", "flags")
    assert {k: second[k] for k in picked} == {k: first[k] for k in picked}
    if X86_LINUX:  # only x86 loads its probes in a subprocess
        assert second["valid"], "an x86 machine has at least one vector set"


# -- the memo alone, on a stand-in probe (each `_remembered` a new process's)


def _probe_counting(calls: list[str], failing: str = "") -> Callable[[object, str], bool]:
    def probe(isa: object, library: str) -> bool:
        calls.append(library)
        return library != failing

    return probe


def test_a_load_is_noted_once_per_library(tmp_path: Path) -> None:
    libraries = [tmp_path / "a.so", tmp_path / "b.so"]
    for library in libraries:
        library.write_bytes(b"built")
    calls: list[str] = []
    for _ in range(3):
        remembered = _remembered(_probe_counting(calls), lambda: str(tmp_path / "cache"))
        assert all(remembered(None, str(lib)) for lib in libraries)
    assert calls == [str(lib) for lib in libraries]
    notes = os.listdir(tmp_path / "cache" / "sexpgpu" / "isa-probes")
    assert len(notes) == 2 and not any(n.endswith(".tmp") for n in notes)


def test_a_failed_load_is_tried_again(tmp_path: Path) -> None:
    library = tmp_path / "a.so"
    library.write_bytes(b"built")
    calls: list[str] = []
    for _ in range(2):
        probe = _probe_counting(calls, failing=str(library))
        assert not _remembered(probe, lambda: str(tmp_path / "cache"))(None, str(library))
    assert calls == [str(library)] * 2
    assert not (tmp_path / "cache" / "sexpgpu").exists()


def test_a_rebuilt_library_is_loaded_again(tmp_path: Path) -> None:
    library = tmp_path / "a.so"
    library.write_bytes(b"built")
    calls: list[str] = []
    _remembered(_probe_counting(calls), lambda: str(tmp_path / "cache"))(None, str(library))
    library.write_bytes(b"built again, by another compiler")
    _remembered(_probe_counting(calls), lambda: str(tmp_path / "cache"))(None, str(library))
    assert calls == [str(library)] * 2


def test_a_missing_library_or_unwritable_cache_probes_as_usual(tmp_path: Path) -> None:
    calls: list[str] = []
    missing = str(tmp_path / "missing.so")
    assert _remembered(_probe_counting(calls), lambda: str(tmp_path))(None, missing)
    library = tmp_path / "a.so"
    library.write_bytes(b"built")
    (tmp_path / "file").write_text("a file where the cache folder should be")
    for _ in range(2):
        assert _remembered(_probe_counting(calls), lambda: str(tmp_path / "file"))(
            None, str(library)
        )
    assert calls == [missing, str(library), str(library)]
