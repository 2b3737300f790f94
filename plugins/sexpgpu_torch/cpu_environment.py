"""The choices that decide the CPU's summation order, without torch.

Beside the kernel choices, a run on the CPU records (``experiment.json``
``choices``) what makes its sums add up in one order: the intra-op thread count
(``cpu.threads``), ATen's vector capability (``cpu.capability``), the BLAS
library (``cpu.blas``) and, for MKL, its conditional-numerical-reproducibility
branch (``cpu.blas.cbwr``), and the torch version (``torch.version``). The
lowering reads them from torch (:mod:`sexpgpu_torch.cpu`); this module holds what
runs before torch is imported.

A resume pins them. ATen reads ``ATEN_CPU_CAPABILITY`` and OpenMP its thread count
once, when they start, so ``sexpgpu run`` asks the lowering for the
environment of its pinned choices (``LoweringInfo.environment``:
:func:`environment_for`) and sets it before anything imports torch; the lowering
then checks that torch took every pinned value and refuses one it did not take
with ``E-CHOICE-001``. A pin that could not be set is therefore loud, never
silent, which is why the environment is set in-process rather than by
re-executing the command: a second start would cost a second interpreter and
signal set-up and still need the same check. ``ATEN_CPU_CAPABILITY`` is only set
to a capability this processor has (torch would otherwise run instructions the
processor lacks). Several ranks (data parallel) each take the same pins.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

THREADS = "cpu.threads"
CAPABILITY = "cpu.capability"
BLAS = "cpu.blas"
CBWR = "cpu.blas.cbwr"
TORCH_VERSION = "torch.version"

MOST_THREADS = 1 << 16
"""A thread count past this is no machine's: a forged or damaged record."""

CPU_CHOICES = (THREADS, CAPABILITY, BLAS, CBWR, TORCH_VERSION)
"""The recorded names; every other name in ``choices`` is a kernel choice site."""

ENVIRONMENT = {THREADS: "OMP_NUM_THREADS", CAPABILITY: "ATEN_CPU_CAPABILITY"}
"""The variable that a pinned value is handed to before torch starts. MKL's mode
(``cpu.blas.cbwr``) is not one: the lowering sets it through MKL itself
(:mod:`sexpgpu_torch.mkl`), since ``MKL_CBWR`` cannot say "off", the mode an unset
variable leaves."""

# The /proc/cpuinfo flags torch's own dispatch requires for each x86 capability.
_X86_FLAGS = {
    "default": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
}
_X86_MACHINES = ("x86_64", "amd64", "i686", "i386")


def is_cpu_choice(name: str) -> bool:
    """Whether ``name`` is one of :data:`CPU_CHOICES` (not a kernel choice site)."""
    return name in CPU_CHOICES


def processor_has(capability: str, cpuinfo: str | None = None) -> bool:
    """Whether this processor can run ATen's ``capability`` (``default`` always can).

    Known for x86 from the ``/proc/cpuinfo`` flags; another capability or
    architecture is not known here, and is not set (the lowering then refuses it
    unless torch chose it by itself).
    """
    if capability == "default":
        return True
    needed = _X86_FLAGS.get(capability)
    if needed is None or platform.machine().lower() not in _X86_MACHINES:
        return False
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
                cpuinfo = handle.read()
        except OSError:
            return False
    flags = next(
        (ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), []
    )
    return all(flag in flags for flag in needed)


def environment_for(pins: Mapping[str, str]) -> dict[str, str]:
    """The environment that makes torch start with ``pins`` (``LoweringInfo.environment``
    of the torch lowerings): the variables of :data:`ENVIRONMENT` for the pinned
    values it can take here."""
    env: dict[str, str] = {}
    for name, variable in ENVIRONMENT.items():
        value = pins.get(name)
        if value is None:
            continue
        if name == CAPABILITY and not processor_has(value):
            continue
        if name == THREADS and not (value.isdigit() and 1 <= int(value) <= MOST_THREADS):
            continue  # no count a machine runs: the lowering refuses it (E-CHOICE-001)
        if name == THREADS:
            # MKL takes its own count from MKL_NUM_THREADS when set; keep it with OpenMP's.
            env["MKL_NUM_THREADS"] = value
        env[variable] = value
    return env
