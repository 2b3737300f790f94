"""The torch Trainer: determinism, propose/commit, the finite guard, export/restore and resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_build import POS, G, param, program, site, stage

from sexpgpu.choices import Choices
from sexpgpu.errors import CheckpointError
from sexpgpu.extension import Supplies
from sexpgpu.lang.ir import DataDecl, EvalPass, Init, TensorType
from tests.catalogs import project

B, T, D, V = 2, 4, 8, 11
FIELDS = {"inputs": TensorType((B, T), "i64"), "targets": TensorType((B, T), "i64")}


def lower(prog, *, pinned=None):
    plugins = project()
    lowering = next(i for i in plugins.lowerings() if i.name == "torch")
    return lowering.factory().lower(
        prog,
        device="cpu",
        supplies=Supplies(kernels=plugins.kernels(), optimizers=plugins.optimizers()),
        choices=Choices(recorded=pinned or {}),
    )


def lm_graph(*, dropout: bool = True, metrics: bool = False):
    """A tiny language model: embedding, a repeated attention+MLP block, a head."""
    g = G()
    tokens = g.input("inputs", [B, T], "i64")
    targets = g.input("targets", [B, T], "i64")
    x = g.add("take", g.param("model.embed", [V, D]), tokens)
    body = G()
    carry = body.input("carry", [B, T, D])
    h = body.add("layer_norm", carry, body.slot(0, [D]), body.slot(1, [D]), eps=1e-5)
    q = body.add("matmul", h, body.slot(2, [D, D]))
    a = body.add("attention", q, h, h, heads=2, causal=True, site="attention:model.blocks.attn")
    if dropout:
        a = body.add("dropout", a, p=0.25, key=2)
    r = body.add("add", carry, a)
    m = body.add("gelu", body.add("matmul", r, body.slot(3, [D, D])))
    out = body.add("add", r, m)
    slots = tuple(
        tuple(f"model.blocks.{i}.{n}" for n in ("ln.w", "ln.b", "q", "ff")) for i in range(2)
    )
    x = g.add(
        "repeat",
        x,
        count=2,
        body=body.graph(out),
        slots=slots,
        site="stack:model.blocks",
        type=g.nodes[x].type,
    )
    if dropout:
        x = g.add("dropout", x, p=0.1, key=1)
    logits = g.add("matmul", x, g.param("model.head", [D, V]))
    if metrics:
        return g.graph(g.add("cross_entropy", logits, targets), g.add("accuracy", logits, targets))
    return g.graph(g.add("cross_entropy", logits, targets))


def lm_params(frozen_bf16: bool = False):
    params = [param("model.embed", [V, D], init=Init("normal", (0.3,)))]
    for i in range(2):
        params += [
            param(f"model.blocks.{i}.ln.w", [D], init=Init("ones"), tags=("no-decay",)),
            param(f"model.blocks.{i}.ln.b", [D], init=Init("zeros"), tags=("no-decay",)),
            param(f"model.blocks.{i}.q", [D, D], init=Init("xavier")),
            param(f"model.blocks.{i}.ff", [D, D], init=Init("kaiming")),
        ]
    params.append(param("model.head", [D, V], init=Init("uniform", (-0.3, 0.3))))
    return params


SITES = [site("attention:model.blocks.attn", "attention"), site("stack:model.blocks", "stack")]


def lm_program(*, seed=7, stages=None, evals=(), dropout=True):
    stages = stages or [
        stage(lm_graph(dropout=dropout), FIELDS, optimizer="adamw", options={"lr": 0.01})
    ]
    return program(lm_params(), stages, sites=SITES, seed=seed, evals=evals)


def batches(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {
            "inputs": rng.integers(0, V, (B, T)).astype(np.int64),
            "targets": rng.integers(0, V, (B, T)).astype(np.int64),
        }
        for _ in range(n)
    ]


def train(trainer, data, *, first_step=1, stage_of=lambda step: 0, lr=0.01):
    losses = []
    for i, batch in enumerate(data):
        step = first_step + i
        proposal = trainer.propose(batch, stage=stage_of(step), step=step, lr=lr)
        assert trainer.find_non_finite(proposal) is None
        trainer.commit(proposal)
        losses.append(proposal.loss)
    return losses


def assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].tobytes() == b[key].tobytes(), f"{key} differs"


def test_same_file_and_seed_give_the_same_bits_after_every_step() -> None:
    """Two runs of one program and seed agree bit for bit after each step, whatever
    the global RNG says (no draw uses it)."""
    data = batches(4)
    runs = []
    for global_seed in (1, 12345):
        torch.manual_seed(global_seed)
        trainer = lower(lm_program())
        trainer.init_params()
        exports = [trainer.export()]
        for step, batch in enumerate(data, 1):
            trainer.commit(trainer.propose(batch, stage=0, step=step, lr=0.01))
            exports.append(trainer.export())
        runs.append(exports)
    for (pa, sa), (pb, sb) in zip(runs[0], runs[1], strict=True):
        assert_same_bits(pa, pb)
        assert_same_bits(sa, sb)
    # ... and the steps did change the parameters.
    assert runs[0][0][0]["model.head"].tobytes() != runs[0][-1][0]["model.head"].tobytes()


def test_init_depends_on_seed_and_path() -> None:
    a, b = lower(lm_program(seed=1)), lower(lm_program(seed=2))
    a.init_params()
    b.init_params()
    pa, pb = a.export()[0], b.export()[0]
    assert pa["model.head"].tobytes() != pb["model.head"].tobytes()
    # Two same-shaped parameters under one seed get different draws.
    assert pa["model.blocks.0.q"].tobytes() != pa["model.blocks.1.q"].tobytes()
    assert np.array_equal(pa["model.blocks.0.ln.w"], np.ones(D, np.float32))
    assert np.abs(pa["model.head"]).max() <= 0.3


def test_dropout_masks_follow_the_step_and_stack_kernels_agree() -> None:
    """Dropout draws from (seed, step, key[, iteration]): the looped and unrolled stacks
    give the same bits, and a step's loss depends on its step number."""
    data = batches(1)
    results = {}
    for kernel in ("unrolled", "looped"):
        trainer = lower(lm_program(), pinned={"stack:model.blocks": kernel})
        assert trainer.choices["stack:model.blocks"] == kernel
        trainer.init_params()
        losses = [trainer.propose(data[0], stage=0, step=s, lr=0.01).loss for s in (1, 2, 1)]
        results[kernel] = losses
    assert results["unrolled"] == results["looped"]
    assert results["unrolled"][0] == results["unrolled"][2]
    assert results["unrolled"][0] != results["unrolled"][1]


def test_a_refused_proposal_changes_nothing() -> None:
    trainer = lower(lm_program())
    trainer.init_params()
    train(trainer, batches(2))
    before = trainer.export()
    for step in (3, 3, 3):  # proposed three times, never committed
        proposal = trainer.propose(batches(1, seed=5)[0], stage=0, step=step, lr=0.5)
    after = trainer.export()
    assert_same_bits(before[0], after[0])
    assert_same_bits(before[1], after[1])
    trainer.commit(proposal)
    assert trainer.export()[0]["model.head"].tobytes() != before[0]["model.head"].tobytes()


def _two_param_program(optimizer: str, options: dict):
    g = G()
    x1 = g.input("x1", [3])
    x2 = g.input("x2", [3])
    a = g.param("model.a", [3])
    b = g.param("model.b", [3])
    loss = g.add(
        "add",
        g.add("sum", g.add("mul", a, x1), axes=(0,), keepdim=False),
        g.add("sum", g.add("mul", b, x2), axes=(0,), keepdim=False),
    )
    fields = {"x1": TensorType((3,), "f32"), "x2": TensorType((3,), "f32")}
    return program(
        [param("model.a", [3]), param("model.b", [3])],
        [stage(g.graph(loss), fields, optimizer=optimizer, options=options)],
    )


def test_find_non_finite_names_the_first_offender_and_counts_it() -> None:
    trainer = lower(_two_param_program("sgd", {"lr": 0.1}))
    trainer.init_params()
    ok = {"x1": np.ones(3, np.float32), "x2": np.ones(3, np.float32)}
    assert trainer.find_non_finite(trainer.propose(ok, stage=0, step=1, lr=0.1)) is None
    bad = {"x1": np.ones(3, np.float32), "x2": np.array([1, np.inf, 2], np.float32)}
    before = trainer.export()[0]
    proposal = trainer.propose(bad, stage=0, step=1, lr=0.1)
    assert trainer.find_non_finite(proposal) == ("parameter", "model.b", 1)
    # The check left the proposal (and the parameters) as they were.
    assert_same_bits(before, trainer.export()[0])
    worse = {"x1": np.full(3, np.nan, np.float32), "x2": np.full(3, np.nan, np.float32)}
    assert trainer.find_non_finite(trainer.propose(worse, stage=0, step=1, lr=0.1)) == (
        "parameter",
        "model.a",
        3,
    )


def test_find_non_finite_reports_a_state_after_its_parameter() -> None:
    """Adam's v overflows for a huge gradient while the parameter stays finite."""
    trainer = lower(_two_param_program("adam", {"lr": 0.1}))
    trainer.init_params()
    batch = {"x1": np.ones(3, np.float32), "x2": np.array([1, 1e30, 1], np.float32)}
    proposal = trainer.propose(batch, stage=0, step=1, lr=0.1)
    assert trainer.find_non_finite(proposal) == ("state", "model.b/v", 1)


def test_export_restore_round_trip_is_bit_exact_and_resume_continues_to_the_bit() -> None:
    """Stop after 3 steps, restore into a fresh trainer, go on: the bits of a run never
    stopped, across a change of stage and optimizer."""
    graph = lm_graph()
    stages = [
        stage(graph, FIELDS, optimizer="sgd", options={"lr": 0.1, "momentum": 0.9}, steps=2),
        stage(graph, FIELDS, optimizer="adam", options={"lr": 0.01}, steps=2, clip=0.5),
        stage(graph, FIELDS, optimizer="adam", options={"lr": 0.002}, steps=2),
    ]
    prog = lm_program(stages=stages)

    def stage_of(step: int) -> int:
        return (step - 1) // 2

    data = batches(6)
    straight = lower(prog)
    straight.init_params()
    train(straight, data, stage_of=stage_of)
    expected = straight.export()
    assert set(expected[1]) == {f"{p.path}/{n}" for p in prog.params for n in ("m", "v")}

    for stop in (2, 3, 5):
        first = lower(prog)
        first.init_params()
        train(first, data[:stop], stage_of=stage_of)
        params, states = first.export()
        resumed = lower(prog)
        resumed.init_params()
        resumed.restore(params, states, stage=stage_of(stop))
        again = resumed.export()
        assert_same_bits(params, again[0])
        assert_same_bits(states, again[1])
        train(resumed, data[stop:], first_step=stop + 1, stage_of=stage_of)
        got = resumed.export()
        assert_same_bits(expected[0], got[0])
        assert_same_bits(expected[1], got[1])


def test_restore_refuses_what_does_not_fit() -> None:
    trainer = lower(lm_program())
    trainer.init_params()
    train(trainer, batches(1))
    params, states = trainer.export()
    wrong = dict(params, **{"model.head": np.zeros((V, D), np.float32)})
    with pytest.raises(CheckpointError, match="model.head has shape"):
        trainer.restore(wrong, states, stage=0)
    missing = {k: v for k, v in states.items() if k != "model.head/v"}
    with pytest.raises(CheckpointError, match="lacks the optimizer state model.head/v"):
        trainer.restore(params, missing, stage=0)
    with pytest.raises(CheckpointError, match="model.nope"):
        trainer.restore(dict(params, **{"model.nope": np.zeros(1, np.float32)}), states, stage=0)


def test_bf16_parameters_export_as_f32_and_restore_bit_exactly() -> None:
    g = G()
    x = g.input("x", [4, 3])
    w = g.param("model.w", [3, 2], "bf16")
    loss = g.add("mse", g.add("matmul", g.add("cast", x, dtype="bf16"), w), g.input("y", [4, 2]))
    fields = {"x": TensorType((4, 3), "f32"), "y": TensorType((4, 2), "f32")}
    prog = program(
        [param("model.w", [3, 2], dtype="bf16")],
        [stage(g.graph(loss), fields, optimizer="adam", options={"lr": 0.01})],
    )
    trainer = lower(prog)
    trainer.init_params()
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.standard_normal((4, 3)).astype(np.float32),
        "y": rng.standard_normal((4, 2)).astype(np.float32),
    }
    trainer.commit(trainer.propose(batch, stage=0, step=1, lr=0.01))
    params, states = trainer.export()
    assert params["model.w"].dtype == np.float32
    assert states["model.w/m"].dtype == np.float32
    # Every exported value is a bf16 value: its low 16 bits are zero.
    assert not (params["model.w"].view(np.uint32) & 0xFFFF).any()
    other = lower(prog)
    other.init_params()
    other.restore(params, states, stage=0)
    assert other.params["model.w"].dtype == torch.bfloat16
    assert_same_bits(params, other.export()[0])


def test_evaluate_runs_a_pass_without_dropout() -> None:
    data_decl = DataDecl("val", "test", {}, T, B, FIELDS, POS)
    evals = [EvalPass("eval", 2, data_decl, 1, ("loss", "accuracy"), lm_graph(metrics=True))]
    trainer = lower(lm_program(evals=evals))
    trainer.init_params()
    batch = batches(1)[0]
    first = trainer.evaluate("eval", batch)
    assert set(first) == {"loss", "accuracy"}
    assert first == trainer.evaluate("eval", batch)  # no dropout: the same every time
    assert 0.0 <= first["accuracy"] <= 1.0
    before = trainer.export()[0]
    trainer.evaluate("eval", batch)
    assert_same_bits(before, trainer.export()[0])
    no_dropout = lower(lm_program(dropout=False))
    no_dropout.init_params()
    loss = no_dropout.propose(batch, stage=0, step=1, lr=0.01).loss
    assert first["loss"] == pytest.approx(loss, rel=1e-6)


def test_consecutive_stages_with_the_same_optimizer_share_states() -> None:
    """A stage whose optimizer differs only in lr carries the states (and Adam's count) on."""
    graph = lm_graph(dropout=False)
    one = lm_program(stages=[stage(graph, FIELDS, optimizer="adam", options={"lr": 0.01}, steps=4)])
    two = lm_program(
        stages=[
            stage(graph, FIELDS, optimizer="adam", options={"lr": 0.01}, steps=2),
            stage(graph, FIELDS, optimizer="adam", options={"lr": 0.05}, steps=2),
        ]
    )
    data = batches(4)
    a, b = lower(one), lower(two)
    a.init_params()
    b.init_params()
    train(a, data)
    train(b, data, stage_of=lambda s: 0 if s <= 2 else 1)
    assert_same_bits(a.export()[0], b.export()[0])
    assert_same_bits(a.export()[1], b.export()[1])


def test_a_batch_without_a_field_is_a_one_line_error() -> None:
    from sexpgpu.errors import RunError

    trainer = lower(lm_program())
    trainer.init_params()
    with pytest.raises(RunError, match="the batch has no field 'targets'"):
        trainer.propose({"inputs": batches(1)[0]["inputs"]}, stage=0, step=1, lr=0.01)


def test_set_params_replaces_loaded_parameters_by_value() -> None:
    trainer = lower(lm_program())
    trainer.init_params()
    head = np.arange(D * V, dtype=np.float32).reshape(D, V)
    trainer.set_params({"model.head": head})
    assert trainer.export()[0]["model.head"].tobytes() == head.tobytes()
    with pytest.raises(CheckpointError, match="shape"):
        trainer.set_params({"model.head": head.T})
