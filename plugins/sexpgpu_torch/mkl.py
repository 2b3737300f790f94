"""MKL's conditional numerical reproducibility (CNR) mode, read and set through MKL's
own service functions in the library torch loaded.

Without CNR, MKL may take another code path for the same matrix product from one
process to the next: on an AMD EPYC a run started fresh and the same run resumed
from its checkpoint multiplied in two orders, because the resume set
``MKL_CBWR=AUTO`` (CNR on) where the fresh run had left it unset (CNR off), and
both had recorded ``AUTO``. So the mode is read from MKL itself, never from the
environment, and every run takes one CNR mode before its first matrix product.

MKL takes a mode only before its first BLAS call in the process
(``MKL_CBWR_ERR_MODE_CHANGE_FAILURE`` after); a process that has multiplied
already (a program embedding sexpgpu) keeps its mode, and it is that mode which
is recorded.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

STRICT = 0x10000
"""MKL_CBWR_STRICT: the flag beside a branch (``AVX2,STRICT``)."""
_ALL = -1  # MKL_CBWR_ALL: the branch and its flags
_BRANCHES = {
    1: "OFF",  # MKL_CBWR_BRANCH_OFF: CNR off, MKL's mode when MKL_CBWR is unset
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    5: "SSE3",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
}
_CODES = {name: code for code, name in _BRANCHES.items()}
_SERVICE_NAMES = (("mkl_cbwr_get", "mkl_cbwr_set"), ("mkl_serv_cbwr_get", "mkl_serv_cbwr_set"))

Service = tuple[Callable[[int], int], Callable[[int], int]]


@functools.cache
def _service() -> Service | None:
    """MKL's ``cbwr_get`` and ``cbwr_set`` as torch links them (statically, inside
    ``libtorch_cpu``); ``None`` where torch has no MKL or does not export them."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    for handle in _libraries(library):
        for get_name, set_name in _SERVICE_NAMES:
            getter, setter = getattr(handle, get_name, None), getattr(handle, set_name, None)
            if getter is None or setter is None:
                continue
            for function in (getter, setter):
                function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            return getter, setter
    return None


def _libraries(path: str) -> list[ctypes.CDLL]:
    """The process's own symbols, then torch's CPU library where it is a file."""
    handles = [ctypes.CDLL(None)]
    if os.path.exists(path):
        try:
            handles.append(ctypes.CDLL(path))
        except OSError:
            pass
    return handles


def name_of(code: int) -> str:
    """MKL's name of a mode, as ``MKL_CBWR`` spells it: ``AUTO``, ``AVX2,STRICT``;
    ``OFF`` for CNR off."""
    branch = _BRANCHES.get(code & 0xFFFF, f"BRANCH_{code & 0xFFFF}")
    return f"{branch},STRICT" if code & STRICT else branch


def code_of(name: str) -> int | None:
    """The mode named ``name`` (:func:`name_of`'s spelling, any case); ``None`` for a
    name MKL has no code for."""
    branch, _, flag = name.upper().partition(",")
    if branch not in _CODES or flag not in ("", "STRICT"):
        return None
    return _CODES[branch] | (STRICT if flag else 0)


def mode() -> str | None:
    """The mode MKL runs in this process (:func:`name_of`); ``None`` where it cannot be
    asked (no MKL, or its service functions are not exported)."""
    service = _service()
    return None if service is None else name_of(service[0](_ALL) & 0x1FFFF)


def set_mode(name: str) -> bool:
    """Ask MKL to run in the mode ``name``; whether it now does. MKL refuses a change
    after its first BLAS call, and a branch the processor lacks."""
    service, code = _service(), code_of(name)
    if service is None or code is None:
        return False
    return service[1](code) == 0 and mode() == name_of(code)
