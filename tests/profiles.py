"""Machine profiles for the bit tests: what a user's machine may start torch with.

Most of the suite runs `sexpgpu` with ``OMP_NUM_THREADS=1`` on the processor's own
ATen capability. That hides whatever a run does differently when nothing is set: a
fresh run at the thread count it chooses against its resume, which pins the count
(issue 49 was such a case: MKL's mode left unset by a fresh run and set by its
resume); and two threads, which a small program never chooses, come from
``two-threads-lower-isa``. The bit tests run under these profiles too, so what differs between the
machine a test was written on and another shows up on either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from sexpgpu_torch.cpu_environment import processor_has

STARTUP_VARIABLES = ("OMP_", "GOMP_", "KMP_", "MKL_", "ATEN_CPU_CAPABILITY")
"""What a profile decides: every such variable of the test's own environment is left out."""


def machine_capability() -> str:
    """ATen's capability on this processor when nothing is set."""
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def lower_capability() -> str:
    """A capability below the machine's that this processor runs: ``avx2`` on an
    AVX-512 machine, else ``default`` (scalar)."""
    return "avx2" if machine_capability() == "avx512" and processor_has("avx2") else "default"


PROFILES: dict[str, dict[str, str]] = {
    "one-thread": {"OMP_NUM_THREADS": "1"},
    "default-threads": {},
    "two-threads-lower-isa": {"OMP_NUM_THREADS": "2"},
}
"""Each profile's start-up settings (the lower capability is added where it is named)."""


SUITE_PROFILE = os.environ.get("SEXPGPU_TEST_PROFILE", "one-thread")
"""The profile of every `sexpgpu` the suite starts, unless a test names its own:
``SEXPGPU_TEST_PROFILE=default-threads python -m pytest`` runs the whole suite so."""
if SUITE_PROFILE not in PROFILES:
    raise SystemExit(f"SEXPGPU_TEST_PROFILE={SUITE_PROFILE}: one of {', '.join(sorted(PROFILES))}")


def suite_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (the process's environment) with the suite's profile's start-up settings."""
    return profile_env(SUITE_PROFILE, base)


def profile_env(name: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (the process's environment) with the start-up settings of the profile
    ``name`` in place of its own."""
    env = {
        k: v for k, v in (os.environ if base is None else base).items()
        if not k.startswith(STARTUP_VARIABLES)
    }  # fmt: skip
    env.update(PROFILES[name])
    if name.endswith("lower-isa"):
        env["ATEN_CPU_CAPABILITY"] = lower_capability()
    return env
