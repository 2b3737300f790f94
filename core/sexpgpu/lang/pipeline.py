"""The compiler's passes in order, each over the results of the ones before it:

1. ``collect`` (:mod:`.collect`): sources -> :class:`Definitions`
2. ``settle`` (:mod:`.knobs`): definitions, ``--set``, variant, ``--steps`` -> :class:`Knobs`
3. ``read_defrun`` (:mod:`.defrun`): the ``defrun`` -> :class:`RunForm`
4. ``elaborate`` (:mod:`.elaborate`): the roots -> :class:`Model` (instances, parameters)
5. ``plan`` (:mod:`.plan`): settings, stages, evals -> :class:`RunPlan`
6. ``graphs`` (:mod:`.graphs`): the plan over the model -> :class:`Graphs`
7. ``assemble`` (here): all of it -> the checked :class:`sexpgpu.lang.ir.Program`

A pass raises the first mistake it finds, and the passes after it do not run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from sexpgpu.lang import ir as g
from sexpgpu.lang.collect import collect
from sexpgpu.lang.definitions import Definitions, SourceText
from sexpgpu.lang.defrun import read_defrun
from sexpgpu.lang.elaborate import elaborate
from sexpgpu.lang.graphs import Graphs, build_graphs
from sexpgpu.lang.knobs import Knobs, settle_knobs
from sexpgpu.lang.model import Model
from sexpgpu.lang.plan import plan_run

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.syntax import FileCheck

__all__ = ["assemble", "compile_program"]


def compile_program(
    core: SourceText,
    main: SourceText,
    catalog: Catalog,
    sets: Mapping[str, str],
    variant: str | None,
    steps: int | None,
    *,
    check_files: bool = True,
    files: FileCheck | None = None,
) -> g.Program:
    """Run every pass on the prelude ``core`` and the file ``main``, against ``catalog``
    (``check_files``, ``files``: see :func:`sexpgpu.lang.compile_file`)."""
    defs = collect(core, main, files=files)
    knobs = settle_knobs(defs, sets, variant, steps)
    run = read_defrun(defs)
    model = elaborate(defs, knobs, run, catalog, files=files)
    plan = plan_run(defs, knobs, run, catalog, check_files=check_files, files=files)
    graphs = build_graphs(plan, model, knobs, catalog)
    return assemble(defs, knobs, variant, model, plan.settings, graphs)


def assemble(
    defs: Definitions,
    knobs: Knobs,
    variant: str | None,
    model: Model,
    settings: g.RunSettings,
    graphs: Graphs,
) -> g.Program:
    """The program the passes' results make."""
    return g.Program(
        file=defs.file,
        sources=defs.sources,
        knobs=knobs.knobs,
        variant=variant,
        params=model.params,
        run=settings,
        stages=graphs.stages,
        evals=graphs.evals,
        sites=graphs.sites,
    )
