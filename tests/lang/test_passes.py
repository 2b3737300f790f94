"""Each compiler pass on its own: given the results of the passes before it (made
by hand or by those passes), it returns its typed result, and later passes never run."""

from __future__ import annotations

import hashlib

import pytest
from lang_helpers import BASE, CATALOG, RUN, compile_text

from sexpgpu.errors import Pos, SourceError, UsageError
from sexpgpu.lang import core_source
from sexpgpu.lang.builder import Builder, Ctx, GraphEnv, Sites
from sexpgpu.lang.collect import collect, layer_def
from sexpgpu.lang.definitions import CORE_NAME, Definitions, KnobDef, SourceText, VariantDef
from sexpgpu.lang.defrun import RunForm, read_defrun
from sexpgpu.lang.elaborate import elaborate
from sexpgpu.lang.expr import ExprCompiler
from sexpgpu.lang.graphs import build_graphs, loss_graph
from sexpgpu.lang.ir import Knob, LoadSpec, Stage, TensorType
from sexpgpu.lang.knobs import Knobs, settle_knobs
from sexpgpu.lang.model import Instance, Model, Stack
from sexpgpu.lang.optable import OpTable
from sexpgpu.lang.pipeline import assemble, compile_program
from sexpgpu.lang.plan import EvalPlan, RunPlan, StagePlan, plan_run
from sexpgpu.lang.reader import Kw, read
from sexpgpu.lang.static import Statics

P = Pos("t.sx", 1, 1)


def _source(text: str, file: str = "t.sx") -> SourceText:
    return SourceText(text, text.encode(), file, file, None)


def _core() -> SourceText:
    data = core_source()
    return SourceText(data.decode(), data, CORE_NAME, CORE_NAME, None)


def _defs(text: str) -> Definitions:
    return collect(_core(), _source(text))


def _expr(text: str):
    (node,) = read(text, "e.sx")
    return node


def _through_elaborate(text: str, **settle):
    defs = _defs(text)
    knobs = settle_knobs(defs, settle.get("sets", {}), settle.get("variant"), None)
    run = read_defrun(defs)
    return defs, knobs, run, elaborate(defs, knobs, run, CATALOG)


PROGRAM = BASE + f"(defrun t {RUN})\n"

# ---------------------------------------------------------------- collect


def test_collect_reads_the_prelude_then_the_file_into_definitions():
    defs = _defs(PROGRAM)
    assert defs.file == "t.sx"
    assert [s.name for s in defs.sources] == [CORE_NAME, "t.sx"]
    assert defs.sources[1].sha256 == hashlib.sha256(PROGRAM.encode()).hexdigest()
    assert list(defs.layers) == ["net"] and "mlp" in defs.core_layers
    assert defs.knobs["lr"] == KnobDef("lr", 0.5, "float", "learning rate", Pos("t.sx", 2, 10))
    assert list(defs.datas) == ["train"] and defs.run is not None
    net = defs.layers["net"]
    assert net.params == ("vocab", "dim") and net.forward_args == ("tokens",)


def test_collect_evaluates_nothing():
    # an unknown layer, data source and option are the later passes' to find
    text = "(defdata d (nosuch :x 1) :batch 0)\n(defrun r :model (nothing) :bogus 1)\n"
    defs = _defs(text)
    assert list(defs.datas) == ["d"] and defs.run is not None


def test_collect_reads_an_include_once_relative_to_its_file(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.sx").write_text('(include "b.sx")\n(defknob a 1)\n')
    (tmp_path / "lib" / "b.sx").write_text("(defknob b 2)\n")
    main = str(tmp_path / "m.sx")
    text = '(include "lib/a.sx")\n(include "lib/b.sx")\n'  # b twice: by a, then by m
    defs = collect(_core(), SourceText(text, text.encode(), main, "m.sx", main))
    assert [s.name for s in defs.sources] == [CORE_NAME, "m.sx", "lib/a.sx", "lib/b.sx"]
    assert list(defs.knobs) == ["b", "a"]


@pytest.mark.parametrize(
    ("files", "chain", "where"),
    [
        ({"m.sx": '(include "m.sx")'}, "m.sx -> m.sx", "m.sx:1:10"),
        (
            {
                "m.sx": '(include "lib/a.sx")',
                "lib/a.sx": '(include "b.sx")',
                "lib/b.sx": '(defknob b 2)\n(include "../m.sx")',
            },  # fmt: skip
            "m.sx -> lib/a.sx -> lib/b.sx -> m.sx",
            "lib/b.sx:2:10",
        ),
        (
            {"m.sx": '(include "a.sx")', "a.sx": '(include "b.sx")', "b.sx": '(include "a.sx")'},
            "a.sx -> b.sx -> a.sx",
            "b.sx:1:10",
        ),
    ],
)
def test_an_include_cycle_is_an_error_naming_the_chain(tmp_path, files, chain, where):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    main = str(tmp_path / "m.sx")
    text = files["m.sx"]
    with pytest.raises(SourceError) as raised:
        collect(_core(), SourceText(text, text.encode(), main, "m.sx", main))
    assert str(raised.value).endswith(f"include cycle: {chain}")
    assert str(raised.value).startswith(str(tmp_path / where))


def test_collect_keeps_the_preludes_layers_apart():
    defs = _defs("(deflayer mlp (d) (forward (x) x))")
    assert defs.layers["mlp"].params == ("d",)
    assert defs.core_layers["mlp"].params != ("d",)


def test_collect_refuses_a_second_defrun():
    with pytest.raises(SourceError, match=r"t.sx:2:1: a program has one defrun; the first is at"):
        _defs("(defrun a)\n(defrun b)\n")


def test_layer_def_reads_one_form():
    (form,) = read('(deflayer twice (n) "doc" (param w [n]) (forward (x) (* x 2)))', "l.sx")
    ldef = layer_def(form)
    assert (ldef.name, ldef.kind, ldef.params, ldef.doc) == ("twice", "deflayer", ("n",), "doc")
    assert len(ldef.items) == 1 and ldef.forward_args == ("x",)


# ---------------------------------------------------------------- settle


def _knob_defs() -> Definitions:
    """Definitions made by hand: the settle pass needs no sources."""
    lr = KnobDef("lr", 0.5, "float", "rate", P)
    steps = KnobDef("steps", 10, "int", "", P)
    fast = VariantDef("fast", P, ((Kw("lr", P), _expr("2")),))
    return Definitions("t.sx", (), {}, {}, {"lr": lr, "steps": steps}, {"fast": fast}, {}, None)


def test_settle_defaults():
    knobs = settle_knobs(_knob_defs(), {}, None, None)
    assert knobs.knobs == (
        Knob("lr", 0.5, 0.5, "default", "rate"),
        Knob("steps", 10, 10, "default", ""),
    )
    assert knobs.values == {"lr": 0.5, "steps": 10}


def test_settle_default_then_variant_then_command_line():
    knobs = settle_knobs(_knob_defs(), {"steps": "3"}, "fast", None)
    assert knobs.knobs == (
        Knob("lr", 2.0, 0.5, "variant", "rate"),
        Knob("steps", 3, 10, "command line", ""),
    )
    knobs = settle_knobs(_knob_defs(), {"lr": "0.25"}, "fast", 7)
    assert knobs.values == {"lr": 0.25, "steps": 7}


def test_settle_refuses_a_command_line_mistake():
    with pytest.raises(UsageError, match="unknown variant 'fats' \\(did you mean 'fast'\\?\\)"):
        settle_knobs(_knob_defs(), {}, "fats", None)
    with pytest.raises(UsageError, match=r"--set lr=fast: knob 'lr' takes a number"):
        settle_knobs(_knob_defs(), {"lr": "fast"}, None, None)


def test_settle_checks_every_variant_chosen_or_not():
    defs = _defs('(defknob lr 0.5)\n(defvariant odd :lr "x")\n')
    with pytest.raises(SourceError, match=r"t.sx:2:21: knob 'lr' takes a number, got \"x\""):
        settle_knobs(defs, {}, None, None)


# ---------------------------------------------------------------- read_defrun


def test_read_defrun_gives_its_options_unevaluated():
    run = read_defrun(_defs(PROGRAM))
    assert run.name == "t"
    assert list(run.opts) == ["model", "data", "loss", "optimizer", "steps"]


def test_read_defrun_without_one_points_at_the_file():
    with pytest.raises(SourceError) as info:
        read_defrun(_defs("(defknob a 1)"))
    assert info.value.pos == Pos("t.sx", 1, 1)


# ---------------------------------------------------------------- elaborate


def test_elaborate_makes_the_roots_and_their_parameters():
    _, _, _, model = _through_elaborate(PROGRAM)
    assert list(model.roots) == ["model"]
    net = model.roots["model"]
    assert net.statics == {"vocab": 16, "dim": 8}
    assert [(p.path, p.type) for p in model.params] == [
        ("model.embed", TensorType((16, 8), "f32")),
        ("model.head", TensorType((8, 16), "f32")),
    ]
    assert net.params["embed"] is model.params[0]


def test_elaborate_reads_settled_knobs():
    text = "(defknob width 4)\n" + PROGRAM.replace("(net 16 8)", "(net 16 width)")
    _, _, _, model = _through_elaborate(text, sets={"width": "6"})
    assert model.params[0].type == TensorType((16, 6), "f32")


def test_elaborate_leaves_data_optimizer_and_loss_alone():
    text = BASE + "(defrun t :model (net 16 8) :data nodata :optimizer (nosuch) :loss (huh))"
    _, _, _, model = _through_elaborate(text)
    assert len(model.params) == 2


def test_elaborate_makes_stacks_and_a_loaded_root():
    text = """
(deflayer blk (d) (param w [d d]) (forward (x) (matmul x w)))
(defmodel net (d) (layer blocks (repeat 3 (blk d))) (forward (x) (blocks x)))
(defrun t :model (net 4) :with-loaded (teacher (net 2) :file "t.safetensors" :names "m.{name}"))
"""
    _, _, _, model = _through_elaborate(text)
    stack = model.roots["model"].subs["blocks"]
    assert isinstance(stack, Stack) and stack.count == 3
    assert [p.path for p in model.params] == [
        "model.blocks.0.w",
        "model.blocks.1.w",
        "model.blocks.2.w",
        "teacher.blocks.0.w",
        "teacher.blocks.1.w",
        "teacher.blocks.2.w",
    ]
    teacher = model.params[-1]
    assert not teacher.trainable
    assert teacher.load == LoadSpec("t.safetensors", "m.blocks.2.w")


# ---------------------------------------------------------------- plan


def test_plan_settles_the_settings_and_plans_each_stage_and_eval():
    text = BASE + (
        "(defrun t :model (net 16 8) :data train :optimizer (adam :lr lr) :seed 3"
        " :stages ((stage a :steps 2 :loss (mean (model inputs)))"
        "          (stage b :steps 1 :loss (sum (model inputs))))"
        " :evals ((eval e :every 1)))"
    )
    defs = _defs(text)
    knobs = settle_knobs(defs, {}, None, None)
    plan = plan_run(defs, knobs, read_defrun(defs), CATALOG)
    assert plan.settings.name == "t" and plan.settings.seed == 3
    a, b, e = list(plan.items)
    assert isinstance(a, StagePlan) and (a.name, a.steps, a.data.name) == ("a", 2, "train")
    assert a.optimizer.name == "adam" and a.optimizer.options["lr"] == 0.5
    assert isinstance(b, StagePlan) and b.name == "b"
    assert isinstance(e, EvalPlan) and (e.name, e.every, e.batches) == ("e", 1, 1)
    # an eval's data and loss are the first stage's when the run gives none
    assert e.data is a.data and e.loss is a.loss
    assert "loss" in e.registered


def test_plan_resolves_each_stage_only_when_asked():
    text = BASE + (
        "(defrun t :model (net 16 8) :optimizer (adam :lr lr) :loss (mean (model inputs))"
        " :stages ((stage a :steps 2 :data train) (stage b :steps 1 :data nodata)))"
    )
    defs = _defs(text)
    plan = plan_run(defs, settle_knobs(defs, {}, None, None), read_defrun(defs), CATALOG)
    items = iter(plan.items)
    assert next(items).name == "a"
    with pytest.raises(SourceError, match="unknown data 'nodata'"):
        next(items)


# ---------------------------------------------------------------- graphs


def _exprs() -> ExprCompiler:
    return ExprCompiler(Statics({"k": 3}), GraphEnv(OpTable(CATALOG)))


def test_the_expression_visitor_compiles_alone():
    exprs = _exprs()
    b = Builder(exprs.env)
    fields = {"x": TensorType((2, 4), "f32")}
    ctx = Ctx(b, None, {}, fields)
    out = exprs.expr(_expr("(let [y (* x k)] (-> y (+ 1) mean))"), ctx)
    assert out.type == TensorType((), "f32")
    assert [n.op for n in b.nodes] == ["input", "const", "mul", "const", "add", "mean"]
    assert exprs.expr(_expr("(if true x 0)"), ctx).id == 0  # the input read once
    assert exprs.expr(_expr("(+ k 2)"), ctx) == 5  # a value known before training folds


def test_sites_name_each_place_once():
    sites = Sites()
    first = sites.site("attention", "model.a", P, {"heads": 2, "body": None})
    assert sites.site("attention", "model.a", P, {}) == first == "attention:model.a"
    assert sites.site("attention", "model.a", Pos("t.sx", 2, 1), {}) == "attention:model.a#2"
    assert sites.named()[0].attrs == {"heads": 2}
    assert sites.dropout_key("loss", P) == 0 and sites.dropout_key("loss", Pos("t.sx", 9, 9)) == 1
    assert sites.dropout_key("loss", P) == 0


def test_graphs_compile_a_plan_made_by_hand():
    defs, knobs, run, model = _through_elaborate(PROGRAM)
    planned = plan_run(defs, knobs, run, CATALOG)
    main = next(iter(planned.items))
    loss = _expr("(mean (dropout (cast (model inputs) f32) :p 0.5))")
    stages = [StagePlan(name, 1, main.data, main.optimizer, loss) for name in ("a", "b")]
    graphs = build_graphs(RunPlan(planned.settings, iter(stages)), model, knobs, CATALOG)
    assert [s.name for s in graphs.stages] == ["a", "b"] and graphs.evals == ()
    keys = [n.attrs["key"] for s in graphs.stages for n in s.loss.nodes if n.op == "dropout"]
    assert keys == [0, 0]  # one place written, one key, whichever graph it is in


def test_loss_graph_needs_a_scalar():
    defs, knobs, _, model = _through_elaborate(PROGRAM)
    stage = next(iter(plan_run(defs, knobs, read_defrun(defs), CATALOG).items))
    exprs = ExprCompiler(Statics(knobs.values), GraphEnv(OpTable(CATALOG)))
    with pytest.raises(SourceError, match="the loss must be a scalar"):
        loss_graph(exprs, _expr("(model inputs)"), stage.data.fields, model.roots)


# ---------------------------------------------------------------- assemble and the pipeline


def test_assemble_packs_the_results():
    defs, knobs, run, model = _through_elaborate(PROGRAM)
    plan = plan_run(defs, knobs, run, CATALOG)
    graphs = build_graphs(plan, model, knobs, CATALOG)
    program = assemble(defs, knobs, "v", model, plan.settings, graphs)
    assert program.file == "t.sx" and program.variant == "v"
    assert program.params == model.params and program.knobs == knobs.knobs
    assert all(isinstance(s, Stage) for s in program.stages)


def test_the_passes_in_order_are_the_compiler():
    text = PROGRAM.replace(":steps steps", ":steps steps :evals ((eval e :every 2))")
    whole = compile_text(text, "t.sx", sets={"lr": "0.1"})
    passes = compile_program(_core(), _source(text), CATALOG, {"lr": "0.1"}, None, None)
    assert passes == whole


def test_pass_results_are_typed_records():
    defs, knobs, run, model = _through_elaborate(PROGRAM)
    assert isinstance(defs, Definitions) and isinstance(knobs, Knobs)
    assert isinstance(run, RunForm) and isinstance(model, Model)
    assert isinstance(model.roots["model"], Instance)
    with pytest.raises(AttributeError):
        knobs.knobs = ()  # type: ignore[misc]
