"""Fixtures of the compiled lowering's tests.

torch.compile costs tens of seconds per program on a small CPU, so every test here
compiles into the pytest run's one folder of torch's compile caches
(``TORCHINDUCTOR_CACHE_DIR``, tests/conftest.py's ``torch_compile_cache``, shared by
every xdist worker): a program compiled once in the run is read back from there by
every later process. The compiling itself runs in `sexpgpu` subprocesses only (its
worker threads would outlive a test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import run_sexpgpu, sexpgpu_env


@pytest.fixture(scope="session")
def compiled_env(torch_compile_cache: Path) -> dict[str, str]:
    """The environment of a `sexpgpu` subprocess that compiles into the run's caches."""
    return sexpgpu_env(TORCHINDUCTOR_CACHE_DIR=str(torch_compile_cache))


def run_named(folder: Path, env: dict[str, str], file: str, name: str, *args: str):
    """``sexpgpu run FILE`` in ``folder``, checkpointing to ``name`` and its metrics in
    ``metrics-<name>``: one of a module's runs, told apart by ``name``."""
    return run_sexpgpu(
        "run",
        file,
        "--checkpoint-dir",
        name,
        "--metrics-dir",
        f"metrics-{name}",
        *args,
        cwd=folder,
        env=env,
        timeout=600,
    )
