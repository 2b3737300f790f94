"""The choices that decide the CPU's summation order, without torch.

Beside the kernel choices, a run on the CPU records (``experiment.json``
``choices``) what makes its sums add up in one order: the intra-op thread count
(``cpu.threads``), ATen's vector capability (``cpu.capability``), the BLAS
library (``cpu.blas``) and, for MKL, its conditional-numerical-reproducibility
branch (``cpu.blas.cbwr``), and the torch version (``torch.version``). The torch
lowering reads them from torch (``sexpgpu_torch.cpu``); this module holds what
runs before torch is imported.

A resume pins them. ATen reads ``ATEN_CPU_CAPABILITY`` and MKL reads
``MKL_CBWR`` once, when they start, so ``sexpgpu run --resume`` reads the
checkpoint's ``experiment.json`` first and sets the environment
(:func:`pin_environment`) before anything imports torch; the lowering then
checks that torch took every pinned value and refuses one it did not take with
``E-CHOICE-001``. A pin that could not be set is therefore loud, never silent,
which is why the environment is set in-process rather than by re-executing the
command: a second start would cost a second interpreter and signal set-up and
still need the same check. ``ATEN_CPU_CAPABILITY`` is only set to a capability
this processor has (torch would otherwise run instructions the processor lacks).

Several ranks (data parallel) each take the same pins: a rank calls
:func:`pins_for` and :func:`pin_environment` with the checkpoint's choices for
that rank; nothing here assumes one process.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

THREADS = "cpu.threads"
CAPABILITY = "cpu.capability"
BLAS = "cpu.blas"
CBWR = "cpu.blas.cbwr"
TORCH_VERSION = "torch.version"

CPU_CHOICES = (THREADS, CAPABILITY, BLAS, CBWR, TORCH_VERSION)
"""The recorded names; every other name in ``choices`` is a kernel choice site."""

ENVIRONMENT = {THREADS: "OMP_NUM_THREADS", CAPABILITY: "ATEN_CPU_CAPABILITY", CBWR: "MKL_CBWR"}
"""The variable that a pinned value is handed to before torch starts."""

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


def pins_for(
    recorded: Mapping[str, str] | None, *, fresh: bool, threads: int | None
) -> dict[str, str] | None:
    """The pins a run hands its lowering: a resume's ``recorded`` choices (none with
    ``fresh``), and ``--threads`` as the ``cpu.threads`` pin when given.

    ``--threads`` against a pinned resume that recorded another count is
    ``E-CHOICE-001``: the user asked for two things at once.
    """
    from sexpgpu.errors import CheckpointError

    pins = dict(recorded) if recorded is not None and not fresh else {}
    if threads is not None:
        old = pins.get(THREADS)
        if old is not None and old != str(threads):
            raise CheckpointError(
                f"the recorded choice '{old}' for {THREADS} cannot be taken with --threads "
                f"{threads} (use --choices fresh to choose again, or drop --threads)",
                code="E-CHOICE-001",
            )
        pins[THREADS] = str(threads)
    return pins or None


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
    """The environment that makes torch start with ``pins``: the variables of
    :data:`ENVIRONMENT` for the pinned values it can take here."""
    env: dict[str, str] = {}
    for name, variable in ENVIRONMENT.items():
        value = pins.get(name)
        if value is None:
            continue
        if name == CAPABILITY and not processor_has(value):
            continue
        if name == THREADS:
            # MKL takes its own count from MKL_NUM_THREADS when set; keep it with OpenMP's.
            env["MKL_NUM_THREADS"] = value
        env[variable] = value
    return env


def recorded_choices(resume: str, checkpoint_dir: str | None) -> dict[str, str] | None:
    """The ``choices`` of the checkpoint ``--resume resume`` names, read without torch;
    ``None`` when there is none, or when it cannot be read: the run's own read then
    reports that, with its error."""
    from sexpgpu import checkpoint as ckpt
    from sexpgpu.errors import SexpError

    try:
        found = ckpt.resolve_resume(resume, checkpoint_dir)
        if found is None:
            return None
        experiment = ckpt.read_experiment(*found)
    except (SexpError, OSError):
        return None
    return {str(k): str(v) for k, v in experiment.get("choices", {}).items()}


def pin_environment(
    resume: str | None, checkpoint_dir: str | None, *, fresh: bool, threads: int | None
) -> dict[str, str]:
    """Set, in ``os.environ``, what torch must start with for this run; returns it.

    Called by ``sexpgpu run`` before torch is imported: a pinned resume takes the
    checkpoint's values, ``--threads`` its count. Errors are left to the run
    (it reads the checkpoint again and reports what is wrong).
    """
    from sexpgpu.errors import CheckpointError

    recorded = recorded_choices(resume, checkpoint_dir) if resume else None
    try:
        pins = pins_for(recorded, fresh=fresh, threads=threads)
    except CheckpointError:  # the run raises the same error, in its place
        pins = None
    env = environment_for(pins or {})
    overridden = {k: v for k, v in env.items() if k in os.environ and os.environ[k] != v}
    os.environ.update(env)
    if overridden and recorded is not None and not fresh:
        from sexpgpu.log import get_logger

        # This machine's own setting was set aside: say so, the run did move.
        get_logger("sexpgpu.run").info(
            "environment pinned to the checkpoint's choices", **overridden
        )
    return env
