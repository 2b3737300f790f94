"""What the torch plugin's lowerings set on a CUDA machine, record, and do with streams.

- The switches: the eager lowering's determinism switches, and the compiled
  lowering's (TF32 matmuls, ``cuda.tf32``; the determinism switches of a
  deterministic run, inductor's included).
- Which kernels this GPU can run (flash attention needs sm80+ and bf16; the CUDA
  kernels themselves are the ``cuda`` plugin's, and these are the facts of torch's
  SDPA backends and cuDNN they rest on).
- The cuDNN engine of the chosen convolution kernels.
- :class:`PinnedSnapshots`: a checkpoint's device-to-host copy into reused, pinned
  host buffers on a side stream.

Every ``cuda.*`` choice is a CUDA choice: pinned on a CPU run it is ``E-CHOICE-001``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sexpgpu.choices import cannot_take
from sexpgpu.errors import PluginError
from sexpgpu.extension import KernelInfo
from sexpgpu.kernels import device_kind
from sexpgpu.lang.ir import Program

TF32 = "cuda.tf32"
"""Recorded ``on`` or ``off``: whether f32 matmuls and convolutions may round to TF32."""
GPU = "cuda.device"
"""Recorded: the GPU's name and compute capability (not refused elsewhere, only shown)."""
CUDA_PREFIX = "cuda."
ALIGN = "cuda.align"
"""The recorded multiple every matrix product's inner and outer dimension is padded
to on a GPU (``off``: as declared): cuBLAS falls back to Turing-era kernels when a
leading dimension is not a multiple of 8, as a 50257-wide vocabulary's is (38% of a
GPT-2 small step), and takes its best tiles at multiples of 64."""
DEFAULT_ALIGN = "64"

_SWITCH_VALUES = {TF32: ("on", "off"), ALIGN: ("off", "8", "16", "32", "64", "128")}


def take_eager_determinism(program: Program, device: str) -> None:
    """The eager lowering's determinism switches for a deterministic ``program``: the
    fixed cuBLAS workspace (set before CUDA starts, on either device), and on CUDA
    the deterministic paths of the ops that have one."""
    if not program.run.deterministic:
        return
    # cuBLAS needs a fixed workspace to be deterministic; set before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device_kind(device) == "cuda":
        # Makes the ops with a nondeterministic CUDA default (embedding and
        # index backward) take their deterministic path; warn_only keeps an
        # op without one usable rather than failing the run. The CPU ops we
        # use are deterministic already, so the CPU path is left alone.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def take_switches(
    program: Program, device: str, pinned: Mapping[str, str] | None
) -> dict[str, str]:
    """Set the compiled lowering's switches for ``program`` on ``device``; the choices
    to record.

    On the CPU nothing is set and a pinned ``cuda.*`` choice is refused. On CUDA a
    deterministic run sets torch's determinism switches (deterministic algorithms,
    no cuDNN benchmarking, a fixed cuBLAS workspace, inductor's deterministic mode)
    and TF32 is ``off`` unless pinned ``on``; a run that is not deterministic takes
    TF32 ``on`` unless pinned ``off``.
    """
    pins = {k: str(v) for k, v in (pinned or {}).items() if k.startswith(CUDA_PREFIX)}
    if device_kind(device) != "cuda":
        for name, value in sorted(pins.items()):
            raise cannot_take(name, value, f"a CUDA choice on {device_kind(device)}")
        if program.run.deterministic:
            # Inductor's CPU code adds into indexed rows (an embedding's backward) with
            # atomic adds across its threads, so the order, and the bits, change from
            # process to process; in torch's deterministic mode it calls ATen's
            # ordered kernel instead. Read when a graph compiles.
            torch.use_deterministic_algorithms(True)
        return {}
    if not torch.cuda.is_available():
        raise PluginError(f"--device {device}: torch sees no CUDA device here")
    for name, value in pins.items():
        allowed = _SWITCH_VALUES.get(name)
        if allowed is not None and value not in allowed:
            raise cannot_take(name, value, f"it is none of {', '.join(allowed)}")
    deterministic = program.run.deterministic
    if deterministic:
        set_determinism()
    tf32 = pins.get(TF32, "off" if deterministic else "on")
    torch.backends.cuda.matmul.allow_tf32 = tf32 == "on"
    torch.backends.cudnn.allow_tf32 = tf32 == "on"
    where = torch.device(device)
    major, minor = torch.cuda.get_device_capability(where)
    return {TF32: tf32, GPU: f"{torch.cuda.get_device_name(where)} sm{major}{minor}"}


def take_alignment(device: str, pinned: Mapping[str, str] | None) -> tuple[int, dict[str, str]]:
    """The multiple a GPU run pads its matrix products to (0 on the CPU, where nothing is
    padded and nothing recorded), and the choice to record: the pinned one, else
    :data:`DEFAULT_ALIGN`."""
    value = (pinned or {}).get(ALIGN)
    if device_kind(device) != "cuda":
        if value is not None:
            raise cannot_take(ALIGN, value, f"a CUDA choice on {device_kind(device)}")
        return 0, {}
    value = value or DEFAULT_ALIGN
    if value not in _SWITCH_VALUES[ALIGN]:
        raise cannot_take(ALIGN, value, f"it is none of {', '.join(_SWITCH_VALUES[ALIGN])}")
    return (0 if value == "off" else int(value)), {ALIGN: value}


def set_determinism() -> None:
    """Torch's determinism switches, before any CUDA work: only deterministic
    algorithms (an op without one fails instead of running), cuDNN without
    benchmarking, the cuBLAS workspace that makes it deterministic, and inductor's
    deterministic mode where this torch has it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only=False: flash attention's backward takes its deterministic path only so
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True


# Why a kernel cannot run on this GPU for this program; None when it can.
def _flash_unfit(program: Program, capability: tuple[int, int]) -> str | None:
    if capability < (8, 0):
        return "it needs sm80 or newer"
    if program.run.precision != "bf16":
        return "it needs :precision bf16"
    return None


def _cudnn_attention_unfit(program: Program, capability: tuple[int, int]) -> str | None:
    if capability < (8, 0) or not torch.backends.cudnn.is_available():
        return "it needs cuDNN on sm80 or newer"
    return _flash_unfit(program, capability)


_UNFIT = {("attention", "flash"): _flash_unfit, ("attention", "cudnn"): _cudnn_attention_unfit}


def runnable(kernels: Sequence[KernelInfo], program: Program, device: str) -> list[KernelInfo]:
    """``kernels`` less those this GPU cannot run for ``program`` (a pinned one of
    them is then ``E-CHOICE-001``, by the core's rule). All of them on the CPU, where
    the CUDA ones do not fit anyway."""
    if device_kind(device) != "cuda":
        return list(kernels)
    capability = torch.cuda.get_device_capability(torch.device(device))
    return [
        k
        for k in kernels
        if (check := _UNFIT.get((k.kind, k.name))) is None or check(program, capability) is None
    ]


def take_conv_engine(chosen: Mapping[str, KernelInfo], device: str) -> None:
    """Set cuDNN's algorithm selection for the chosen convolution kernels (process-wide:
    benchmarking when any chose ``cudnn-benchmark``)."""
    if device_kind(device) != "cuda":
        return
    engines = {k.name for k in chosen.values() if k.kind == "conv2d"}
    if "cudnn-benchmark" in engines:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = False
    elif "cudnn" in engines:
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


class PinnedSnapshots:
    """Device-to-host copies of a checkpoint into pinned host memory on a side stream.

    The host arrays are the trainer's export buffers, reused checkpoint after
    checkpoint; the first time one is seen its memory is page-locked in place
    (``cudaHostRegister``), so the copy runs at pinned speed without a second host
    buffer, and unlocked when the buffer is freed. The copy waits for the work that
    produced the tensors, runs on its own stream, and is complete on return: the
    loop is blocked for the copy only, and the core writes the buffers in the
    background.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.registered: dict[int, Any] = {}

    def _pin(self, array: np.ndarray) -> None:
        root = array
        while isinstance(root.base, np.ndarray):
            root = root.base
        address = root.ctypes.data
        if address in self.registered or root.nbytes == 0:
            return
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(address, root.nbytes, 0)) != 0:
            return  # left pageable: slower, still correct
        self.registered[address] = weakref.finalize(root, _unregister, self.registered, address)

    def copy(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy every tensor into its array; returns when all of them are on the host."""
        if not tensors:
            return
        self._pin(next(iter(arrays.values())))
        producer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(producer)
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                source = t.detach()
                if source.dtype != torch.float32 and source.is_floating_point():
                    source = source.float()  # bf16 is stored as f32
                torch.from_numpy(arrays[name]).copy_(source, non_blocking=True)
                t.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        done.synchronize()


def _unregister(registered: dict[int, Any], address: int) -> None:
    registered.pop(address, None)
    torch.cuda.cudart().cudaHostUnregister(address)
