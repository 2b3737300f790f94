"""What torch sums with on the CPU, read from torch, and the recorded values taken.

The names and the pre-import half are :mod:`sexpgpu_torch.cpu_environment`. Here the
lowering reads what torch runs with (:func:`current`), sets the values that can
still change once torch runs (the thread count, and MKL's reproducibility mode
until MKL's first product: :mod:`sexpgpu_torch.mkl`) and refuses with
``E-CHOICE-001`` a pinned value that torch did not take (:func:`take`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from sexpgpu.choices import cannot_take
from sexpgpu.errors import CheckpointError
from sexpgpu.kernels import device_kind
from sexpgpu_torch import mkl
from sexpgpu_torch.cpu_environment import (
    BLAS,
    CAPABILITY,
    CBWR,
    MOST_THREADS,
    THREADS,
    TORCH_VERSION,
    is_cpu_choice,
)

# Why a pinned value that torch did not take cannot be taken here, by choice.
_WHY_NOT = {
    THREADS: "torch runs {now} threads",
    CAPABILITY: "torch runs '{now}' on this processor (ATEN_CPU_CAPABILITY is read when torch "
    "starts; sexpgpu run sets it only to a capability the processor has)",
    BLAS: "this torch is built with '{now}'",
    CBWR: "MKL runs in the mode '{now}' (MKL takes another only before its first "
    "matrix product in the process)",
    TORCH_VERSION: "this is torch {now}",
}

DEFAULT_CBWR = "AUTO"
"""MKL's mode for a run that pins none: conditional numerical reproducibility on, in
the processor's own branch. With it off (MKL's default), a product may take another
path in another process, so a resumed run would not add as the run it continues."""


def blas() -> str:
    """The BLAS library torch calls, with MKL's version when it is MKL."""
    config = torch.__config__.show()
    if torch.backends.mkl.is_available():
        version = re.search(r"Math Kernel Library Version ([0-9.]+)", config)
        return f"mkl {version.group(1)}" if version else "mkl"
    info = re.search(r"BLAS_INFO=([^,\s]+)", config)
    return info.group(1) if info else "none"


def current(device: str) -> dict[str, str]:
    """The choices torch runs with now, for a lowering on ``device``: the torch
    version always, and on the CPU the thread count, capability and BLAS."""
    now = {TORCH_VERSION: torch.__version__}
    if device_kind(device) != "cpu":
        return now
    now[THREADS] = str(torch.get_num_threads())
    now[CAPABILITY] = torch.backends.cpu.get_cpu_capability().lower()
    now[BLAS] = blas()
    if now[BLAS].startswith("mkl"):
        # Asked of MKL itself: an unset MKL_CBWR is CNR off, not AUTO.
        now[CBWR] = mkl.mode() or os.environ.get("MKL_CBWR", "unset")
    return now


def take(
    pinned: Mapping[str, str] | None, device: str, threads: int | None = None
) -> dict[str, str]:
    """Set the pinned thread count, check every other pinned value was taken, and
    return the choices to record (:func:`current`).

    ``threads`` is the count a new run takes when none is pinned and the user set no
    ``OMP_NUM_THREADS`` (:mod:`sexpgpu_torch.threads`); ``None`` leaves torch's own.

    A pinned value torch does not run with (a capability the processor lacks,
    another BLAS or torch) is :class:`CheckpointError` ``E-CHOICE-001`` naming the
    choice. Pins of a choice this device does not record are ignored.
    """
    pins = {k: str(v) for k, v in (pinned or {}).items() if is_cpu_choice(k)}
    if device_kind(device) == "cpu":
        _take_threads(pins.get(THREADS), threads)
        _take_cbwr(pins.get(CBWR))
    now = current(device)
    for name, value in sorted(pins.items()):
        if name in now and now[name] != value:
            raise _refused(name, value, _WHY_NOT[name].format(now=now[name]))
    return now


def _take_threads(pinned: str | None, chosen: int | None) -> None:
    """Run the pinned count; else the chosen one unless the user set OpenMP's."""
    if pinned is not None:
        if not pinned.isdigit() or not 1 <= int(pinned) <= MOST_THREADS:
            raise _refused(THREADS, pinned, "it is not a thread count")
        count = int(pinned)
    elif chosen is not None and "OMP_NUM_THREADS" not in os.environ:
        count = chosen
    else:
        return
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def _take_cbwr(pinned: str | None) -> None:
    """Run MKL in the pinned mode, or in :data:`DEFAULT_CBWR` when none is pinned and
    CNR is off. Where MKL no longer takes a mode (it has multiplied in this process),
    it keeps its own: recorded as it is, and a pin it differs from is refused."""
    now = mkl.mode()
    if now is None:
        return
    wanted = pinned if pinned is not None else (DEFAULT_CBWR if now == "OFF" else now)
    if wanted != now:
        mkl.set_mode(wanted)


def _refused(name: str, value: str, why: str) -> CheckpointError:
    return cannot_take(name, value, why)
