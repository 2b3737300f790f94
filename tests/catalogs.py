"""The catalog the tests hand to the product, and shortcuts that hand it in.

:func:`project` is the catalog of the plugins installed in this process, found as
a user's installation finds them (the suite disables third-party distributions:
tests/conftest.py), loaded once per process. A test that changes what is
installed or disabled builds its own with ``Catalog.load()``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sexpgpu import lang
from sexpgpu.catalog import Catalog
from sexpgpu.lang.ir import Program


@dataclass(frozen=True)
class RankOf:
    """This process as rank ``rank`` of ``size`` (the :class:`sexpgpu.extension.RankGroup`
    a launcher's workers join), as far as a trainer placed among ranks reads it before
    a collective: what it owns, and whether it writes."""

    rank: int
    size: int = 2
    nodes: int = 1
    device: str = "cpu"

    @property
    def is_writer(self) -> bool:
        return self.rank == 0


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


def tiny_program(name: str, **options: object) -> str:
    """The source of a tiny run named ``name`` (an embedding and a head, Adam, 4 steps
    of ``(sort :vocab 8)``), with ``options`` added to its ``defrun``
    (``checkpoint_every=2`` becomes ``:checkpoint-every 2``): quick to train in a
    test's own process, and to compile under the compiled lowering."""
    settings = "".join(
        f"\n  :{key.replace('_', '-')} {str(value).lower() if isinstance(value, bool) else value}"
        for key, value in options.items()
    )
    return f"""
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (ids) (matmul (take embed ids) head)))
(defdata train (sort :vocab 8) :seq 4 :batch 4)
(defrun {name}
  :model (net 8 4)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.1)
  :steps 4
  :seed 3{settings})
"""
