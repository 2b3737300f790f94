"""The compiler: `.sx` forms to a checked :class:`sexpgpu.graph.Program`.

It reads the `<core>` prelude and the main file (and what it includes), collects
the top-level definitions, settles the knobs (default < variant < command
line), instantiates the model into parameters, and compiles every loss and
eval expression into a graph whose every node has a shape and dtype. Errors
are :class:`SourceError` at the place the user wrote, or :class:`UsageError`
for command-line mistakes. Nothing here imports torch.

Each concern lives in its own module, mixed into :class:`Compiler`, which holds
the state of one compilation: :mod:`.forms` (sources, top-level forms, knobs),
:mod:`.static` (values known before training), :mod:`.layers` (instances,
parameters, ``:load``), :mod:`.expr` and :mod:`.calls` (expressions and op
calls, through the op registry :mod:`.ops`), :mod:`.runs` (data, optimizers,
``defrun``, stages, evals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu import graph as g
from sexpgpu.errors import Pos
from sexpgpu.lang.calls import PluginOps
from sexpgpu.lang.expr import ExprMixin
from sexpgpu.lang.forms import FormsMixin
from sexpgpu.lang.layers import LayersMixin
from sexpgpu.lang.ops import BUILTINS
from sexpgpu.lang.ops import infer as infer_builtin
from sexpgpu.lang.reader import Kw, SList
from sexpgpu.lang.runs import RunsMixin
from sexpgpu.lang.static import StaticMixin
from sexpgpu.lang.values import CORE_NAME, MAX_REPEAT, KnobDef, LayerDef

__all__ = ["CORE_NAME", "MAX_REPEAT", "Compiler"]


class Compiler(FormsMixin, StaticMixin, LayersMixin, ExprMixin, RunsMixin):
    """One compilation: sources, definitions, knobs, and the program being built."""

    def __init__(self, main_file: str, base_dir: str, catalog: Any):
        self.catalog = catalog
        self.main_file = main_file
        self.base_dir = base_dir
        self.sources: list[g.Source] = []
        self.read_paths: set[str] = set()
        self.layers: dict[str, LayerDef] = {}
        self.core_layers: dict[str, LayerDef] = {}
        self.knobs: dict[str, KnobDef] = {}
        self.variants: dict[str, tuple[Pos, list[tuple[Kw, Any]]]] = {}
        self.datas: dict[str, SList] = {}
        self.data_decls: dict[str, g.DataDecl] = {}
        self.runs: list[SList] = []
        self.sites: dict[str, g.ChoiceSite] = {}
        self.site_keys: dict[tuple, str] = {}
        self.dropout_keys: dict[tuple, int] = {}
        self.params: list[g.ParamDecl] = []
        self.stage_losses: list[Any] = []
        self.plugin_ops = PluginOps(catalog)

    def infer(
        self, op: str, args: Sequence[g.TensorType], attrs: Mapping[str, Any], pos: Pos
    ) -> g.TensorType:
        """The type of a node of ``op``: a built-in's rule, or a plugin op's."""
        spec = BUILTINS.get(op) or self.plugin_ops.get(op)
        if spec is not None and spec.infer is not None and spec.plugin is not None:
            return spec.infer(op, args, attrs, pos)
        return infer_builtin(op, args, attrs, pos)
