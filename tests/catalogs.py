"""The catalog the tests hand to the product, and shortcuts that hand it in.

:func:`project` is the catalog of the plugins installed in this process, found as
a user's installation finds them (the suite disables third-party distributions:
tests/conftest.py), loaded once per process. A test that changes what is
installed or disabled builds its own with ``Catalog.load()``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from sexpgpu import lang
from sexpgpu.catalog import Catalog
from sexpgpu.lang.ir import Program


@functools.cache
def project() -> Catalog:
    """The installed plugins' catalog (this process's, loaded once)."""
    return Catalog.load()


def open_location(uri: str) -> Any:
    """``uri`` opened by the backend that serves its scheme."""
    return project().open_location(uri)


def compile_file(path: str, **kw: Any) -> Program:
    """:func:`sexpgpu.lang.compile_file` against :func:`project`."""
    return lang.compile_file(path, catalog=project(), **kw)


def compile_text(text: str, name: str = "main.sx", **kw: Any) -> Program:
    """:func:`sexpgpu.lang.compile_text` against :func:`project`."""
    return lang.compile_text(text, name, catalog=project(), **kw)


def lower(
    program: Program,
    *,
    device: str = "cpu",
    lowering: str | None = None,
    choose: Mapping[str, str] | None = None,
    recorded: Mapping[str, str] | None = None,
    catalog: Catalog | None = None,
) -> Any:
    """The trainer ``sexpgpu run`` would lower ``program`` into: ``lowering`` and the
    ``--choose`` requests asked for, ``recorded`` choices pinned as a resume pins them."""
    from sexpgpu.session import Target
    from sexpgpu.session import lower as lower_program

    target = Target(device=device, lowering=lowering, choose=dict(choose or {}))
    choices = target.choices(program, recorded)
    return lower_program(program, catalog or project(), device=device, choices=choices).trainer


def open_loader(decl: Any, seed: int) -> Any:
    """A loader on the data source ``decl`` names, from ``seed``."""
    from sexpgpu.session import open_loader as open_data

    return open_data(project(), decl, seed)[1]
