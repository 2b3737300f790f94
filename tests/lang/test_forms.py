"""Each top-level form and defrun option, compiled into the Program it promises."""

from __future__ import annotations

import hashlib
import os

import pytest
from lang_helpers import BASE, RUN, compile_file, compile_text, program

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang import core_source
from sexpgpu.lang.ir import Init, LoadSpec, Schedule, TensorType


def test_minimal_run():
    p = program(BASE, run=RUN)
    assert p.file == "t.sx" and p.run.name == "t" and p.variant is None
    assert [s.name for s in p.sources] == ["<core>", "t.sx"]
    assert p.sources[0].sha256 == hashlib.sha256(core_source()).hexdigest()
    assert p.run.seed == 0 and p.run.checkpoint_every is None and p.run.deterministic
    (stage,) = p.stages
    assert stage.name == "main" and stage.steps == 4
    assert stage.data.name == "train" and stage.data.options == {"digits": 3, "split": "train"}
    assert stage.data.fields == {
        "inputs": TensorType((2, 8), "i64"),
        "targets": TensorType((2, 8), "i64"),
    }
    assert stage.data.seq == 8 and stage.data.batch == 2 and stage.data.pos == Pos("t.sx", 8, 10)
    assert [n.op for n in stage.loss.nodes] == [
        "input",
        "param",
        "take",
        "param",
        "matmul",
        "input",
        "cross_entropy",
    ]
    assert stage.loss.output_types() == (TensorType((), "f32"),)


def test_defknob_doc_and_types():
    p = program(
        '(defknob a 1) (defknob b 1.5 "bee") (defknob c true) (defknob d "s") (defknob e bf16)'
        + BASE,
        run=RUN + " :precision e",
    )
    knobs = {k.name: k for k in p.knobs}
    assert knobs["b"].doc == "bee" and knobs["e"].value == "bf16"
    assert p.run.precision == "bf16"
    assert [k.name for k in p.knobs][:5] == ["a", "b", "c", "d", "e"]


def test_params_dtype_init_frozen_tags():
    body = """
(defmodel net ()
  (param a [2 3] :dtype bf16 :init (uniform -0.5 0.5) :tags (x y))
  (param b [3] :init zeros :frozen true)
  (param c [3] :init ones)
  (param d [3 3] :init xavier)
  (param e [3 3] :init (kaiming 2))
  (param f [3] :init (normal 1))
  (param g [3])
  (forward (x) (+ x b)))
(defdata d (vectors :width 3) :batch 2)
"""
    p = program(
        body,
        run=":model (net) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1",
    )
    got = {x.path: (x.type, x.init, x.trainable, x.tags) for x in p.params}
    assert got["model.a"] == (
        TensorType((2, 3), "bf16"),
        Init("uniform", (-0.5, 0.5)),
        True,
        ("x", "y"),
    )
    assert got["model.b"][1:] == (Init("zeros"), False, ())
    assert got["model.c"][1] == Init("ones")
    assert got["model.d"][1] == Init("xavier", (1.0,))
    assert got["model.e"][1] == Init("kaiming", (2.0,))
    assert got["model.f"][1] == Init("normal", (1.0,))
    assert got["model.g"][1] == Init("normal", (0.02,))
    assert p.param("model.a").pos == Pos("t.sx", 3, 10)


def test_sub_layers_repeat_and_paths():
    body = """
(deflayer inner (d) (param w [d d]) (forward (x) (matmul x w)))
(deflayer outer (d) (layer a (inner d)) (layer b (inner d)) (forward (x) (b (a x))))
(defmodel net (d n)
  (layer blocks (repeat n (outer d)))
  (layer last (linear d d))
  (forward (x) (-> x blocks last)))
(defdata d (vectors :width 4) :batch 2)
"""
    p = program(
        body,
        run=":model (net 4 3) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1",
    )
    assert [x.path for x in p.params] == [
        "model.blocks.0.a.w",
        "model.blocks.0.b.w",
        "model.blocks.1.a.w",
        "model.blocks.1.b.w",
        "model.blocks.2.a.w",
        "model.blocks.2.b.w",
        "model.last.weight",
        "model.last.bias",
    ]
    rep = next(n for n in p.stages[0].loss.nodes if n.op == "repeat")
    assert rep.attrs["count"] == 3 and rep.site == "stack:model.blocks"
    assert rep.attrs["slots"][2] == ("model.blocks.2.a.w", "model.blocks.2.b.w")
    body_graph = rep.attrs["body"]
    assert [n.op for n in body_graph.nodes] == ["input", "param", "matmul", "param", "matmul"]
    assert body_graph.nodes[0].attrs == {"name": "carry"}
    assert body_graph.nodes[1].attrs == {"slot": 0} and body_graph.nodes[3].attrs == {"slot": 1}
    assert [s.name for s in p.sites] == ["stack:model.blocks"]


def test_repeat_must_keep_its_carry_shape():
    body = """
(deflayer grow (a b) (param w [a b]) (forward (x) (matmul x w)))
(defmodel net () (layer s (repeat 2 (grow 4 5))) (forward (x) (s x)))
(defdata d (vectors :width 4) :batch 2)
"""
    with pytest.raises(
        SourceError,
        match=r"repeat: model.s's layer grow gives f32\[2, 5\] but its input is f32\[2, 4\]",
    ):
        program(
            body,
            run=":model (net) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1",
        )


def test_sites_and_dropout_keys():
    body = """
(deflayer att (d) (forward (x) (let [h (dropout x 0.1)] (attention h h (dropout h 0.2) :heads 2))))
(defmodel net (d)
  (layer a (att d)) (layer b (att d)) (layer s (repeat 2 (att d)))
  (forward (x) (let [h (reshape x [1 2 4])] (reshape (s (b (a h))) [2 4]))))
(defdata d (vectors :width 4) :batch 2)
"""
    run = (
        ":model (net 4) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1"
    )
    run += " :evals ((eval e :every 1 :metrics (loss)))"
    p = program(body, run=run)
    assert [s.name for s in p.sites] == [
        "attention:model.a",
        "attention:model.b",
        "attention:model.s",
        "stack:model.s",
    ]
    keys = [n.attrs["key"] for n in p.stages[0].loss.nodes if n.op == "dropout"]
    rep = next(n for n in p.stages[0].loss.nodes if n.op == "repeat")
    keys += [n.attrs["key"] for n in rep.attrs["body"].nodes if n.op == "dropout"]
    assert sorted(keys) == list(range(6))
    eval_keys = [n.attrs["key"] for n in p.evals[0].graph.nodes if n.op == "dropout"]
    assert eval_keys == keys[:4]  # the same dropout has the same key in every graph
    assert {n.site for n in p.evals[0].graph.nodes if n.site} == {
        "attention:model.a",
        "attention:model.b",
        "stack:model.s",
    }


def test_include_records_sources_and_positions(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "layers.sx").write_text(
        '(include "more.sx")\n(deflayer twice (d) (forward (x) (* x 2)))\n'
    )
    (tmp_path / "lib" / "more.sx").write_text("(deflayer bad (d)\n  (forward (x) (matmull x x)))\n")
    main = tmp_path / "run.sx"
    main.write_text(
        '(include "lib/layers.sx")\n(include "lib/layers.sx")\n' + BASE + "(defrun r " + RUN + ")"
    )
    p = compile_file(str(main))
    assert [(s.name, s.path) for s in p.sources] == [
        ("<core>", None),
        ("run.sx", os.path.realpath(main)),
        ("lib/layers.sx", os.path.realpath(tmp_path / "lib" / "layers.sx")),
        ("lib/more.sx", os.path.realpath(tmp_path / "lib" / "more.sx")),
    ]
    assert (
        p.sources[2].sha256
        == hashlib.sha256((tmp_path / "lib" / "layers.sx").read_bytes()).hexdigest()
    )
    # an error in an included file points into it
    main.write_text(
        '(include "lib/layers.sx")\n'
        + BASE.replace(
            "(forward (tokens) (matmul (take embed tokens) head))",
            "(layer z (bad 3)) (forward (tokens) (z (take embed tokens)))",
        )
        + "(defrun r "
        + RUN
        + ")"
    )
    with pytest.raises(SourceError) as info:
        compile_file(str(main))
    assert (
        str(info.value)
        == f"{tmp_path / 'lib' / 'more.sx'}:2:17: unknown op 'matmull' (did you mean 'matmul'?)"
    )


def test_include_of_a_missing_file(tmp_path):
    main = tmp_path / "run.sx"
    main.write_text('\n  (include "nope.sx")')
    with pytest.raises(SourceError) as info:
        compile_file(str(main))
    assert info.value.pos == Pos(str(main), 2, 12)
    assert "cannot read 'nope.sx'" in str(info.value)


def test_user_layer_shadows_the_prelude_but_not_inside_it():
    body = """
(deflayer linear (a b) (forward (x) (* x 3)))
(defmodel net () (layer l (linear 4 4)) (layer m (mlp 4 8)) (forward (x) (m (l x))))
(defdata d (vectors :width 4) :batch 2)
"""
    p = program(
        body,
        run=":model (net) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1",
    )
    assert [x.path for x in p.params] == [
        "model.m.up.weight",
        "model.m.up.bias",
        "model.m.down.weight",
        "model.m.down.bias",
    ]


def test_defdata_options_and_fields():
    body = BASE + "(defdata val (vectors :width 6 :scale 2) :batch 3)"
    p = program(
        body,
        run=RUN + " :evals ((eval v :every 2 :data val :batches 5 :metrics ((m (mean inputs)))))",
    )
    ev = p.evals[0]
    assert ev.name == "v" and ev.every == 2 and ev.batches == 5 and ev.metrics == ("m",)
    assert ev.data.options == {"width": 6, "scale": 2.0} and ev.data.seq == 0
    assert ev.data.fields["inputs"] == TensorType((3, 6), "f32")


def test_data_source_complaints_are_positioned():
    with pytest.raises(SourceError) as info:
        program(
            BASE + "\n(defdata v (vectors :width 0) :batch 3)",
            run=RUN + " :evals ((eval v :every 1 :data v))",
        )
    assert str(info.value) == "t.sx:10:12: data source 'vectors': :width must be at least 1"


def test_optimizer_options_schedule_clip():
    p = program(
        BASE,
        run=RUN.replace(
            "(adam :lr lr)",
            "(adamw :lr lr :weight-decay 0.1 :beta2 0.95 :no-decay-tags (no-decay bias) :schedule (cosine :warmup 10 :min-lr 0.01) :clip 1)",
        ),
    )
    o = p.stages[0].optimizer
    assert o.name == "adamw" and o.clip == 1.0
    assert o.options == {
        "lr": 0.5,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "no_decay_tags": ("no-decay", "bias"),
    }
    assert o.schedule == Schedule("cosine", 10, 0.01)
    p = program(
        BASE,
        run=RUN.replace(
            "(adam :lr lr)",
            "(sgd :lr 0.1 :momentum 0.9 :nesterov true :schedule (warmup :warmup 5))",
        ),
    )
    assert p.stages[0].optimizer.schedule == Schedule("warmup", 5, 0.0)
    assert p.stages[0].optimizer.options["nesterov"] is True


def test_run_settings():
    p = program(
        BASE,
        run=RUN
        + " :seed 11 :precision bf16 :counters (tokens records) :guard-finite true :checkpoint-every 3 :deterministic false",
    )
    r = p.run
    assert (
        r.seed,
        r.precision,
        r.counters,
        r.guard_finite,
        r.checkpoint_every,
        r.deterministic,
    ) == (
        11,
        "bf16",
        ("tokens", "records"),
        True,
        3,
        False,
    )


def test_stages_inherit_and_override():
    body = BASE + "(defdata other (sort :vocab 16) :seq 8 :batch 4)"
    run = """:model (net 16 8) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr lr :schedule (cosine :warmup 2))
  :stages ((stage warm :steps 3 :optimizer (adam :lr 0.1))
           (stage main :steps steps :data other :optimizer (sgd :lr 0.01))
           (stage tail :steps 2 :loss (mean (model inputs))))"""
    p = program(body, run=run, steps=7)
    assert [(s.name, s.steps, s.data.name, s.optimizer.name) for s in p.stages] == [
        ("warm", 3, "train", "adam"),
        ("main", 7, "other", "sgd"),
        ("tail", 2, "train", "adam"),
    ]
    assert p.stages[0].optimizer.options["lr"] == 0.1
    assert (
        p.stages[0].optimizer.schedule.kind == "cosine"
    )  # same optimizer: the run's settings carry over
    assert p.stages[1].optimizer.schedule.kind == "constant"
    assert p.stages[1].loss.nodes[0].type == TensorType((4, 8), "i64")
    assert p.steps == 12


def test_eval_metrics():
    p = program(
        BASE,
        run=RUN
        + " :evals ((eval probe :every 50 :data train :batches 4 :metrics (loss accuracy)) (eval quick :every 5))",
    )
    probe, quick = p.evals
    assert (
        probe.metrics == ("loss", "accuracy") and quick.metrics == ("loss",) and quick.batches == 1
    )
    nodes = probe.graph.nodes
    assert [nodes[i].op for i in probe.graph.outputs] == ["cross_entropy", "accuracy"]
    # the model is compiled once and its logits feed both metrics
    assert sum(n.op == "matmul" for n in nodes) == 1
    assert nodes[probe.graph.outputs[1]].args == nodes[probe.graph.outputs[0]].args


def test_load_and_with_loaded(tmp_path):
    body = BASE.replace(
        "(param head [dim vocab] :init (normal 0.02))",
        '(param head [dim vocab] :load (file "w/weights.safetensors" "lm_head.weight"))\n'
        '  (param head2 [dim vocab] :frozen true :load (file "s3://bkt/m.safetensors.index.json" "x"))',
    )
    run = (
        RUN
        + ' :with-loaded (teacher (net 16 8) :file "teacher.safetensors" :names "{path}.weight")'
    )
    run = run.replace("(model inputs)", "(+ (model inputs) (teacher inputs))")
    p = compile_text(body + f"(defrun r {run})", "runs/my-run.sx")
    got = {x.path: (x.trainable, x.load) for x in p.params}
    assert got["model.head"] == (True, LoadSpec("runs/w/weights.safetensors", "lm_head.weight"))
    assert got["model.head2"] == (False, LoadSpec("s3://bkt/m.safetensors.index.json", "x"))
    assert got["teacher.embed"] == (
        False,
        LoadSpec("runs/teacher.safetensors", "teacher.embed.weight"),
    )
    assert got["teacher.head"] == (False, LoadSpec("runs/w/weights.safetensors", "lm_head.weight"))
    assert [x.root for x in p.params] == ["model"] * 3 + ["teacher"] * 3
    paths = {n.attrs.get("path") for n in p.stages[0].loss.nodes}
    assert {"model.embed", "teacher.embed"} <= paths


@pytest.mark.parametrize(
    ("load", "message"),
    [
        (
            '(file "w.bin" "x")',
            "a :load file is a .safetensors file or a .safetensors.index.json index",
        ),
        (
            '(file "hdfs://b/w.safetensors" "x")',
            "a :load file's scheme 'hdfs' has no storage backend here; schemes: file, gs, s3",
        ),
        ('(file "w.safetensors")', ':load takes (file "weights.safetensors" "tensor.name")'),
        ('(file "w.safetensors" 3)', "(file ...) takes two strings"),
    ],
)
def test_bad_load(load, message):
    body = BASE.replace(
        "(param head [dim vocab] :init (normal 0.02))", f"(param head [dim vocab] :load {load})"
    )
    with pytest.raises(
        SourceError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        program(body, run=RUN)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ("(repeat 5000 (linear 4 4))", "repeat's count 5000 is more than 4096"),
        ("(repeat 0 (linear 4 4))", "repeat's count must be an integer >= 1, got 0"),
        ("(repeat 2 (repeat 2 (linear 4 4)))", "a repeat directly inside a repeat"),
        (
            "(repeat 2 (stacked 4))",
            "model.s.0.inner: a repeat inside a repeated layer is not supported",
        ),
        ("(repeat 2)", "repeat takes a count and a layer"),
    ],
)
def test_bad_stacks(layer, message):
    body = f"""
(deflayer stacked (d) (layer inner (repeat 2 (linear d d))) (forward (x) (inner x)))
(defmodel net () (layer s {layer}) (forward (x) (s x)))
(defdata d (vectors :width 4) :batch 2)
"""
    with pytest.raises(SourceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        program(
            body,
            run=":model (net) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1",
        )


def test_repeat_in_an_expression_says_where_it_belongs():
    body = """
(defmodel net () (forward (x) (repeat 2 x)))
(defdata d (vectors :width 4) :batch 2)
"""
    with pytest.raises(SourceError, match=r"'repeat' is not an op; declare it in a deflayer"):
        program(
            body,
            run=":model (net) :data d :loss (mse (model inputs) targets) :optimizer (sgd :lr 1) :steps 1",
        )


def test_variant_setting_a_knob_twice():
    with pytest.raises(SourceError, match=":lr is set twice in variant v"):
        program(BASE + "(defvariant v :lr 1 :lr 2)", run=RUN)


def test_eval_loss_falls_back_to_the_first_stage():
    run = """:model (net 16 8) :data train :optimizer (adam :lr lr)
  :stages ((stage a :steps 1 :loss (cross-entropy (model inputs) targets)))
  :evals ((eval e :every 1))"""
    p = program(BASE, run=run)
    assert [p.evals[0].graph.nodes[i].op for i in p.evals[0].graph.outputs] == ["cross_entropy"]
