"""MKL's reproducibility mode (``cpu.blas.cbwr``) is read from MKL and set through MKL.

A fresh run once recorded ``AUTO`` for an unset ``MKL_CBWR`` while MKL ran with
conditional numerical reproducibility (CNR) off, and its resume set ``AUTO``: two
modes, two summation orders on an AMD EPYC (issue 49). Each case here starts a new
interpreter, since MKL takes a mode only before its first product and this test
process has multiplied long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sexpgpu_torch import mkl

HAS_MKL = torch.backends.mkl.is_available()

_PROBE = """
import json, sys
import torch
from sexpgpu.errors import CheckpointError
from sexpgpu_torch import cpu, mkl

pins, multiply_first = json.loads(sys.argv[1]), sys.argv[2] == "1"
before = mkl.mode()
if multiply_first:  # a program that embeds sexpgpu after MKL has run
    torch.ones(64, 64) @ torch.ones(64, 64)
try:
    taken = cpu.take(pins, "cpu")
    out = {"before": before, "after": mkl.mode(), "recorded": taken.get("cpu.blas.cbwr")}
except CheckpointError as error:
    out = {"before": before, "refused": error.code, "message": error.message}
print(json.dumps(out))
"""


def probe(pins: dict[str, str], *, cbwr: str | None = None, multiply_first: bool = False) -> dict:
    """What a new interpreter's MKL runs before and after the lowering takes ``pins``."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if cbwr is not None:
        env["MKL_CBWR"] = cbwr
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(pins), "1" if multiply_first else "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_mode_names_round_trip() -> None:
    for name in ("OFF", "AUTO", "COMPATIBLE", "AVX2", "AVX512_E1", "AVX2,STRICT", "AUTO,STRICT"):
        code = mkl.code_of(name)
        assert code is not None and mkl.name_of(code) == name
    assert mkl.code_of("avx2,strict") == mkl.code_of("AVX2,STRICT")
    assert mkl.code_of("AVX3") is None and mkl.code_of("AUTO,LOOSE") is None
    assert mkl.set_mode("NOT-A-MODE") is False


def without_mkl_nothing_is_recorded(seen: dict) -> bool:
    """On a torch built without MKL (aarch64's): no mode is read or recorded, and the
    case's MKL half has nothing to check."""
    if HAS_MKL:
        return False
    assert seen.get("before") is None and seen.get("recorded") is None, seen
    return True


def test_an_unset_mkl_cbwr_is_cnr_off_and_a_run_turns_it_on() -> None:
    seen = probe({})
    if not without_mkl_nothing_is_recorded(seen):
        assert seen == {"before": "OFF", "after": "AUTO", "recorded": "AUTO"}


def test_the_user_s_mkl_cbwr_is_kept_and_recorded_as_mkl_runs_it() -> None:
    seen = probe({}, cbwr="COMPATIBLE")
    if not without_mkl_nothing_is_recorded(seen):
        assert seen == {"before": "COMPATIBLE", "after": "COMPATIBLE", "recorded": "COMPATIBLE"}


# each pin once, each environment at least once (an interpreter a case)
@pytest.mark.parametrize(
    ("pinned", "cbwr"), [("COMPATIBLE", None), ("OFF", "AUTO"), ("AUTO,STRICT", None)]
)
def test_a_pinned_mode_is_set_through_mkl_whatever_the_environment(pinned, cbwr) -> None:
    seen = probe({"cpu.blas.cbwr": pinned}, cbwr=cbwr)
    if not without_mkl_nothing_is_recorded(seen):
        assert seen["after"] == pinned and seen["recorded"] == pinned, seen


def test_after_mkl_has_multiplied_its_mode_is_recorded_as_it_is() -> None:
    seen = probe({}, multiply_first=True)
    if not without_mkl_nothing_is_recorded(seen):
        assert seen == {"before": "OFF", "after": "OFF", "recorded": "OFF"}


def test_a_pin_mkl_can_no_longer_take_is_e_choice_001() -> None:
    seen = probe({"cpu.blas.cbwr": "AUTO"}, multiply_first=True)
    if not without_mkl_nothing_is_recorded(seen):
        assert seen["refused"] == "E-CHOICE-001"
        assert "'AUTO' for cpu.blas.cbwr" in seen["message"]
        assert "'OFF'" in seen["message"] and "--choices fresh" in seen["message"]
