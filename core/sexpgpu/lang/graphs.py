"""The ``graphs`` pass: each planned stage's loss and each eval pass's metrics
compiled, through the expression visitor, into graphs over the model's roots.

The graphs share one :class:`GraphEnv`, so a choice site or dropout written once
is one site and one key across every graph of the program.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import PluginError, Pos, SexpError, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.builder import Builder, Ctx, GraphEnv, T
from sexpgpu.lang.expr import ExprCompiler
from sexpgpu.lang.generate import build_generator
from sexpgpu.lang.knobs import Knobs
from sexpgpu.lang.model import Instance, Model
from sexpgpu.lang.ops import FLOATS
from sexpgpu.lang.optable import OpTable
from sexpgpu.lang.plan import EvalPlan, RunPlan, StagePlan
from sexpgpu.lang.reader import SList, Sym, read, show
from sexpgpu.lang.static import Statics
from sexpgpu.lang.text import describe, err, listing, suggest

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["Graphs", "build_graphs", "loss_graph", "scalar"]


@dataclass(frozen=True)
class Graphs:
    """The program's stages and eval passes, each with its graph, and the choice
    sites their nodes name."""

    stages: tuple[g.Stage, ...]
    evals: tuple[g.EvalPass, ...]
    sites: tuple[g.ChoiceSite, ...]


def build_graphs(plan: RunPlan, model: Model, knobs: Knobs, catalog: Catalog) -> Graphs:
    """Compile ``plan``'s stages and evals over ``model``'s roots; ops no built-in
    names are looked up in ``catalog``."""
    env = GraphEnv(OpTable(catalog))
    exprs = ExprCompiler(Statics(knobs.values), env)
    stages: list[g.Stage] = []
    evals: list[g.EvalPass] = []
    for item in plan.items:
        if isinstance(item, StagePlan):
            gen = None
            if item.sample is not None:
                gen = build_generator(
                    exprs, item.sample, item.data, model.roots, f"stage {item.name}"
                )
            fields = gen.fields if gen else item.data.fields
            loss = loss_graph(exprs, item.loss, fields, model.roots)
            stages.append(g.Stage(item.name, item.steps, item.data, item.optimizer, loss, gen))
        else:
            evals.append(eval_pass(exprs, item, model.roots))
    return Graphs(tuple(stages), tuple(evals), env.sites.named())


def loss_graph(
    exprs: ExprCompiler,
    node: Any,
    fields: Mapping[str, g.TensorType],
    roots: Mapping[str, Instance],
) -> g.Graph:
    """The graph of the loss expression ``node`` on a batch of ``fields``."""
    b = Builder(exprs.env)
    out = scalar(exprs, node, "the loss", Ctx(b, None, {}, fields, roots))
    return b.graph([out])


def scalar(exprs: ExprCompiler, node: Any, what: str, ctx: Ctx) -> T:
    """``node`` compiled to an ``f32`` scalar (``what`` names it in errors)."""
    v = exprs.expr(node, ctx)
    if not isinstance(v, T):
        raise err(f"{what} must be a tensor expression, got {describe(v)}", node.pos)
    if v.type.shape != ():
        raise err(f"{what} must be a scalar, got {v.type}; reduce it, e.g. (mean ...)", node.pos)
    if v.type.dtype != "f32":
        if v.type.dtype not in FLOATS:
            raise err(f"{what} must be floating, got {v.type}", node.pos)
        v = ctx.b.add("cast", [v], {"dtype": "f32"}, node.pos)
    return v


def eval_pass(exprs: ExprCompiler, plan: EvalPlan, roots: Mapping[str, Instance]) -> g.EvalPass:
    """The eval pass ``plan`` with one graph giving each of its metrics.

    A metric is one the plugins supply, by name, or ``(name expression)``.
    """
    gen = None
    if plan.sample is not None:
        gen = build_generator(exprs, plan.sample, plan.data, roots, f"eval {plan.name}")
    b = Builder(exprs.env)
    ctx = Ctx(b, None, {}, gen.fields if gen else plan.data.fields, roots)
    registered = plan.registered
    names: list[str] = []
    outs: list[T] = []
    for mn in plan.metrics:
        if isinstance(mn, Sym) and mn.name in registered:
            mname = mn.name
            supplied = registered[mname]
            if isinstance(supplied, PluginError):  # two plugins supply it, or its is unavailable
                raise SourceError(supplied.message, code=supplied.code, pos=mn.pos)
            out = _registered_metric(exprs, *supplied, mn.pos, plan, ctx)
        elif isinstance(mn, SList) and len(mn.items) == 2 and isinstance(mn.items[0], Sym):
            mname = mn.items[0].name
            if mname in registered:
                # a registered metric's number is finished its own way (perplexity: exp)
                raise err(f"'{mname}' is the name of a metric; name yours otherwise", mn.pos)
            out = scalar(exprs, mn.items[1], f"the metric {mname}", ctx)
        else:
            hint = suggest(mn.name, registered) if isinstance(mn, Sym) else ""
            raise err(
                f"unknown metric {show(mn)}{hint}: a metric is one of "
                f"{listing(registered)}, or (name expression)",
                mn.pos,
            )
        if mname in names:
            raise err(f"metric '{mname}' is listed twice", mn.pos)
        names.append(mname)
        outs.append(out)
    graph = b.graph(outs)
    return g.EvalPass(plan.name, plan.every, plan.data, plan.batches, tuple(names), graph, gen)


def _registered_metric(
    exprs: ExprCompiler, info: Any, plugin: str, pos: Pos, plan: EvalPlan, ctx: Ctx
) -> T:
    """A registered metric's per-batch scalar: its expression compiled with ``logits``
    (the model on ``inputs``) and ``loss`` (the run's) bound when it names them. An
    error inside its text is told at ``pos``, where the user's file names it."""
    try:
        return _metric_expression(exprs, info, pos, plan, ctx)
    except SexpError as exc:
        if exc.pos is None or not exc.pos.file.startswith("<metric "):
            raise
        raise SourceError(
            f"the eval metric '{info.name}' of the plugin '{plugin}' does not fit the pass "
            f"'{plan.name}': {exc.render()}",
            pos=pos,
        ) from None


def _metric_expression(exprs: ExprCompiler, info: Any, pos: Pos, plan: EvalPlan, ctx: Ctx) -> T:
    forms = read(info.expression, f"<metric {info.name}>")
    if len(forms) != 1:
        raise err(f"the metric {info.name}'s expression is not one expression", pos)
    used = _symbols(forms[0])
    bound: dict[str, Any] = {}
    if "loss" in used:
        if plan.loss is None:
            raise err(f"the metric {info.name} needs the run's :loss", pos)
        bound["loss"] = scalar(exprs, plan.loss, "the loss", ctx)
    data = plan.data
    for needed in ("inputs", "targets") if "logits" in used else ():
        if needed not in ctx.fields:
            raise err(
                f"the metric {info.name} compares (model inputs) with targets; "
                f"data '{data.name}' has no field {needed}",
                pos,
            )
    if "logits" in used:
        inputs = ctx.b.input("inputs", ctx.fields["inputs"], pos)
        logits = exprs.call_layer(ctx.roots["model"], [inputs], pos, ctx)
        if not isinstance(logits, T):
            raise err(
                f"the metric {info.name} needs the model to give logits, got {describe(logits)}",
                pos,
            )
        bound["logits"] = logits
    local = Ctx(ctx.b, None, bound, ctx.fields, ctx.roots)
    return scalar(exprs, forms[0], f"the metric {info.name}", local)


def _symbols(node: Any) -> set[str]:
    """Every symbol named anywhere in ``node``."""
    if isinstance(node, Sym):
        return {node.name}
    items = getattr(node, "items", None) or ()
    return set().union(*(_symbols(item) for item in items)) if items else set()
