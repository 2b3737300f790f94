"""The ``plan`` pass: the ``defrun``'s settings, and its stages and eval passes with
the data, optimizers and metrics they name, each resolved against the catalog.

The stages and evals come one at a time, as the ``graphs`` pass asks for them
(:attr:`RunPlan.items` is a generator): each is resolved just before its graph is
built, so a program with several mistakes reports the first one written.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import Pos
from sexpgpu.lang import ir as g
from sexpgpu.lang.declarations import Declarations
from sexpgpu.lang.definitions import Definitions
from sexpgpu.lang.defrun import RunForm
from sexpgpu.lang.generate import SamplePlan, read_sample
from sexpgpu.lang.knobs import Knobs
from sexpgpu.lang.ops import FLOATS
from sexpgpu.lang.reader import SList, SVec, Sym
from sexpgpu.lang.static import Statics
from sexpgpu.lang.syntax import FileCheck, named_form
from sexpgpu.lang.text import err, suggest

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["COUNTERS", "EvalPlan", "RunPlan", "StagePlan", "plan_run"]

COUNTERS = ("tokens", "records", "generated")


@dataclass(frozen=True)
class StagePlan:
    """A stage to train: its steps, data and optimizer, and its loss expression as written."""

    name: str
    steps: int
    data: g.DataDecl
    optimizer: g.OptimizerDecl
    loss: Any
    sample: SamplePlan | None = None
    """Its generator (``:generate``), whose records the loss reads instead of the data."""


@dataclass(frozen=True)
class EvalPlan:
    """An eval pass: when it runs, on what, and its metrics as written (``metrics``),
    with the metrics plugins supply by name (``registered``) and the run's loss
    expression (``None`` when the run has none) that a ``loss`` metric reads."""

    name: str
    every: int
    data: g.DataDecl
    batches: int
    metrics: tuple[Any, ...]
    registered: Mapping[str, Any]
    loss: Any
    pos: Pos
    sample: SamplePlan | None = None


@dataclass(frozen=True)
class RunPlan:
    """The run's settings, and its stages then eval passes (``items``, read once)."""

    settings: g.RunSettings
    items: Iterator[StagePlan | EvalPlan]


def plan_run(
    defs: Definitions,
    knobs: Knobs,
    run: RunForm,
    catalog: Catalog,
    *,
    check_files: bool = True,
    files: FileCheck | None = None,
) -> RunPlan:
    """Plan the run ``run``: its settings and the run's optimizer now, its stages and
    evals as :attr:`RunPlan.items` is read; data and optimizers are looked up in ``catalog``
    (``check_files``: whether each data source's files are checked; ``files``: what
    refuses a data file the program may not read, before it is)."""
    decls = Declarations(
        defs.datas, Statics(knobs.values), catalog, check_files=check_files, files=files
    )
    settings = run_settings(run, decls.statics)
    opts = run.opts
    base = decls.optimizer_decl(opts["optimizer"], None) if "optimizer" in opts else None
    return RunPlan(settings, _items(run, decls, base, settings.counters))


def run_settings(run: RunForm, statics: Statics) -> g.RunSettings:
    """The run's seed, precision, counters, guard, determinism and checkpoint interval."""
    opts, env = run.opts, {}
    seed = statics.int_of(opts["seed"], env, ":seed", 0) if "seed" in opts else 0
    precision = "f32"
    if "precision" in opts:
        precision = statics.word(opts["precision"], env, "a precision")
        if precision not in FLOATS:
            raise err(f":precision is f32 or bf16, got {precision}", opts["precision"].pos)
    counters = _counters(opts["counters"], statics) if "counters" in opts else ()
    guard = (
        statics.bool_of(opts["guard-finite"], env, ":guard-finite")
        if "guard-finite" in opts
        else False
    )
    deterministic = (
        statics.bool_of(opts["deterministic"], env, ":deterministic")
        if "deterministic" in opts
        else True
    )
    every = (
        statics.int_of(opts["checkpoint-every"], env, ":checkpoint-every", 1)
        if "checkpoint-every" in opts
        else None
    )
    # Retention: how many complete checkpoints to keep (None keeps them all).
    keep = statics.int_of(opts["keep-last"], env, ":keep-last", 1) if "keep-last" in opts else None
    shard = None
    if "shard" in opts:
        shard = statics.word(opts["shard"], env, "a sharding")
        if shard not in g.SHARDINGS:
            raise err(f":shard is none, optimizer or full, got {shard}", opts["shard"].pos)
    return g.RunSettings(
        run.name,
        every,
        seed,
        precision,
        counters,
        guard,
        deterministic,
        keep_last=keep,
        shard=shard,
    )


def _counters(node: Any, statics: Statics) -> tuple[str, ...]:
    """``:counters (tokens records)``: known counters, each once."""
    counters = statics.words(node, {}, "counters")
    for c, n in zip(counters, node.items, strict=True):
        if c not in COUNTERS:
            raise err(
                f"unknown counter '{c}'{suggest(c, COUNTERS)}; counters: generated, records, tokens",
                n.pos,
            )
    if len(set(counters)) != len(counters):
        raise err("a counter is listed twice", node.pos)
    return counters


def _items(
    run: RunForm, decls: Declarations, base: g.OptimizerDecl | None, counters: tuple[str, ...]
) -> Iterator[StagePlan | EvalPlan]:
    """The stages, then the evals: an eval's data is the first stage's unless it names
    its own, and its loss the run's, or else the first stage's."""
    first: StagePlan | None = None
    for stage in _stages(run, decls, base):
        if "tokens" in counters:
            _counts_tokens(stage.data, decls)
        first = first or stage
        yield stage
    assert first is not None
    opts = run.opts
    if "evals" not in opts:
        return
    node = opts["evals"]
    if not isinstance(node, (SList, SVec)):
        raise err("(:evals ((eval probe :every 50 ...) ...)) lists eval passes", node.pos)
    loss = opts.get("loss", first.loss)
    taken: set[str] = set()
    for form in node.items:
        yield _eval(form, first.data, loss, decls, taken)


def _counts_tokens(data: g.DataDecl, decls: Declarations) -> None:
    """The counter ``tokens`` counts a field of each stage's data: its source must name one."""
    info = decls.catalog.named("sexpgpu_data_sources", "data source", data.source)
    if info.tokens_field is None:
        raise err(
            f"the data source '{data.source}' has no token field, so the counter 'tokens' "
            "cannot be kept; count records instead",
            data.pos,
        )


def _stages(run: RunForm, decls: Declarations, base: g.OptimizerDecl | None) -> Iterator[StagePlan]:
    """The run's ``:stages``, or its one stage ``main``."""
    opts, form = run.opts, run.form
    if "stages" in opts:
        if "steps" in opts:
            raise err(
                "with :stages, each stage has its own :steps; remove the run's :steps",
                opts["steps"].pos,
            )
        node = opts["stages"]
        if not isinstance(node, (SList, SVec)) or not node.items:
            raise err(
                "(:stages ((stage warm :steps 10 ...) ...)) lists one or more stages", node.pos
            )
        names: set[str] = set()
        for s in node.items:
            yield _stage(s, opts, base, decls, names)
        return
    if "steps" not in opts:
        raise err("defrun needs :steps", form.pos)
    steps = decls.statics.int_of(opts["steps"], {}, ":steps", 1)
    if "data" not in opts:
        raise err("defrun needs :data naming a defdata", form.pos)
    if base is None:
        raise err("defrun needs :optimizer, e.g. :optimizer (adam :lr 0.001)", form.pos)
    if "loss" not in opts:
        raise err("defrun needs :loss, e.g. :loss (cross-entropy (model inputs) targets)", form.pos)
    data = decls.data_decl(opts["data"])
    sample = read_sample(opts["generate"], data, decls) if "generate" in opts else None
    yield StagePlan("main", steps, data, base, opts["loss"], sample)


def _stage(
    sform: Any,
    opts: Mapping[str, Any],
    base: g.OptimizerDecl | None,
    decls: Declarations,
    names: set[str],
) -> StagePlan:
    """One ``(stage name :steps N ...)``; what it leaves out is the run's."""
    name, s = named_form(
        sform,
        "stage",
        "(stage name :steps N ...)",
        names,
        ("steps", "data", "optimizer", "loss", "generate"),
    )
    sname = name.name
    if "steps" not in s:
        raise err(f"stage {sname} needs :steps", sform.pos)
    steps = decls.statics.int_of(s["steps"], {}, ":steps", 1)
    data_node = s.get("data", opts.get("data"))
    if data_node is None:
        raise err(f"stage {sname} needs :data (or give the run :data)", sform.pos)
    optimizer = decls.optimizer_decl(s["optimizer"], base) if "optimizer" in s else base
    if optimizer is None:
        raise err(f"stage {sname} needs :optimizer (or give the run :optimizer)", sform.pos)
    loss = s.get("loss", opts.get("loss"))
    if loss is None:
        raise err(f"stage {sname} needs :loss (or give the run :loss)", sform.pos)
    data = decls.data_decl(data_node)
    generate = s.get("generate", opts.get("generate"))
    sample = read_sample(generate, data, decls) if generate is not None else None
    return StagePlan(sname, steps, data, optimizer, loss, sample)


def _eval(
    form: Any, default_data: g.DataDecl, loss: Any, decls: Declarations, taken: set[str]
) -> EvalPlan:
    """One ``(eval name :every N :data d :batches N :metrics (...))``."""
    name, e = named_form(
        form,
        "eval",
        "(eval name :every N :data d :metrics (loss))",
        taken,
        ("every", "data", "batches", "metrics", "generate"),
    )
    if "every" not in e:
        raise err(f"eval {name.name} needs :every N (steps between passes)", form.pos)
    every = decls.statics.int_of(e["every"], {}, ":every", 1)
    batches = decls.statics.int_of(e["batches"], {}, ":batches", 1) if "batches" in e else 1
    data = decls.data_decl(e["data"]) if "data" in e else default_data
    metrics: tuple[Any, ...] = (Sym("loss", form.pos),)
    if "metrics" in e:
        m = e["metrics"]
        if not isinstance(m, (SList, SVec)) or not m.items:
            raise err("(:metrics (loss accuracy)) lists one or more metrics", m.pos)
        metrics = tuple(m.items)
    registered = decls.eval_metrics(form.pos)
    sample = read_sample(e["generate"], data, decls) if "generate" in e else None
    return EvalPlan(name.name, every, data, batches, metrics, registered, loss, form.pos, sample)
