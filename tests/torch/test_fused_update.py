"""The compiled lowering's fused optimizer updates (``optimizer.update`` = ``fused``):
torch's fused SGD, Adam and AdamW kernels, which compile nothing. Checked here: they
compute the eager updates' values within float tolerance, f32 and bf16 parameters,
with and without decay; a guarded proposal leaves its inputs as they were, an
unguarded one writes into them, and both give the same bits; the choice is recorded,
pinned, and a checkpoint that recorded none resumes with the compiled graph it ran.
A resume in a new process is bit-exact: tests/compiled/test_compiled_runs.py (fused,
unguarded) and the drawn programs (guarded or not). The one program compiled here,
GPT-2 small's at a toy width, also shows its bf16 loss reaching AOTAutograd's cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import sexpgpu_torch.optim as eager
from sexpgpu.catalog import Catalog
from sexpgpu.choices import ChoiceRefused, Choices
from sexpgpu.session import Selection, Target, lower, open_loader
from sexpgpu_torch.compiled import UPDATE, take_update
from sexpgpu_torch.compiled_optim import CompiledUpdate
from sexpgpu_torch.fused_optim import FusedUpdate, fusable

SHAPES = [(5, 3), (7,), (4, 4)]
DECAY = [True, False, True]
CASES = [
    (eager.SGD, {}),
    (eager.SGD, {"momentum": 0.9, "weight_decay": 0.01}),
    (eager.SGD, {"momentum": 0.9, "nesterov": True}),
    (eager.Adam, {"weight_decay": 0.1}),
    (eager.AdamW, {"weight_decay": 0.1, "beta2": 0.95}),
    (eager.AdamW, {}),
]


def _tensors(gen: torch.Generator, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _copies(states: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in v] for k, v in states.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "options"), CASES)
def test_a_fused_update_computes_the_eager_ones_values(kind, options, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    ours, theirs = FusedUpdate(kind()), kind()
    assert fusable(theirs)
    params = _tensors(gen, dtype)
    states = theirs.init_states(params, options)
    p_fused, s_fused = params, _copies(states)
    p_eager, s_eager = params, states
    for count in range(1, 6):
        grads = _tensors(gen, dtype)
        given, given_states = [p.clone() for p in p_fused], _copies(s_fused)
        new, new_states = ours.propose(
            p_fused, grads, s_fused, lr=1e-2, count=count, options=options, decay=DECAY
        )
        # a proposal the guard may refuse: nothing it was given changed
        assert all(torch.equal(a, b) for a, b in zip(given, p_fused, strict=True))
        assert all(
            torch.equal(a, b)
            for k in s_fused
            for a, b in zip(given_states[k], s_fused[k], strict=True)
        )
        p_fused, s_fused = new, new_states
        p_eager, s_eager = theirs.propose(
            p_eager, grads, s_eager, lr=1e-2, count=count, options=options, decay=DECAY
        )
    assert [p.dtype for p in p_fused] == [dtype] * len(SHAPES)  # bf16 stays bf16
    assert all(t.dtype == torch.float32 for v in s_fused.values() for t in v)  # states f32
    for a, b in zip(p_fused, p_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for name in s_eager:
        for a, b in zip(s_fused[name], s_eager[name], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kind", "options"), CASES)
def test_strided_tensors_are_read_in_their_logical_order(kind, options) -> None:
    # a tied embedding's gradient comes transposed (the logits' product with the
    # table's transpose); the fused kernels walk memory in order, whatever the strides
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(tuple(reversed(s)), generator=gen).T for s in SHAPES]
    assert not grads[0].is_contiguous()
    states = kind().init_states(params, options)
    for overwrites in (False, True):
        new, _ = FusedUpdate(kind(), overwrites=overwrites).propose(
            [p.clone() for p in params],
            grads,
            _copies(states),
            lr=1e-2,
            count=1,
            options=options,
            decay=DECAY,
        )
        expected, _ = kind().propose(
            params, grads, states, lr=1e-2, count=1, options=options, decay=DECAY
        )
        for a, b in zip(new, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kind", "options"), CASES)
def test_overwriting_writes_into_the_tensors_given_with_the_copies_bits(kind, options) -> None:
    gen = torch.Generator().manual_seed(1)
    params, grads = _tensors(gen, torch.float32), _tensors(gen, torch.float32)
    states = kind().init_states(params, options)
    copied, copied_states = FusedUpdate(kind()).propose(
        params, grads, states, lr=1e-2, count=1, options=options, decay=DECAY
    )
    mine, my_states = [p.clone() for p in params], _copies(states)
    new, new_states = FusedUpdate(kind(), overwrites=True).propose(
        mine, grads, my_states, lr=1e-2, count=1, options=options, decay=DECAY
    )
    assert all(a is b for a, b in zip(new, mine, strict=True))  # the same tensors, updated
    for name, values in new_states.items():
        assert all(a is b for a, b in zip(values, my_states[name], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(new, copied, strict=True))
    for name in copied_states:
        assert all(
            torch.equal(a, b) for a, b in zip(new_states[name], copied_states[name], strict=True)
        )


class _PluginUpdate:
    """An optimizer a plugin supplies: no fused form."""

    elementwise = False

    def init_states(self, params, options):  # noqa: ANN001
        return {}

    def propose(self, params, grads, states, *, lr, count, options, decay):  # noqa: ANN001
        return [p - lr * g for p, g in zip(params, grads, strict=True)], {}


def test_a_plugins_optimizer_runs_its_own_update() -> None:
    update = FusedUpdate(_PluginUpdate())
    assert not fusable(_PluginUpdate())
    (new,), _ = update.propose(
        [torch.ones(2)], [torch.ones(2)], {}, lr=0.5, count=1, options={}, decay=[True]
    )
    assert torch.equal(new, torch.full((2,), 0.5))


def test_the_choice_a_run_takes() -> None:
    assert take_update(Choices.make()) == "fused"  # a new run
    assert take_update(Choices.make(recorded={"lowering": "compiled"}, fresh=True)) == "fused"
    # a checkpoint written before the choice was recorded ran the compiled graph
    assert take_update(Choices.make(recorded={"lowering": "compiled"})) == "compiled"
    pinned = Choices.make(recorded={"lowering": "compiled", UPDATE: "fused"})
    assert take_update(pinned) == "fused"
    with pytest.raises(ChoiceRefused) as refused:
        take_update(Choices.make(recorded={UPDATE: "fastest"}))
    assert refused.value.code == "E-CHOICE-001"
    assert "optimizer.update" in str(refused.value)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# GPT-2 small's program (bf16, its tied head and its vocabulary) at a toy width: the
# one program this module compiles, in this process
GPT2 = {"dim": "32", "layers": "1", "heads": "2", "context": "16", "batch": "2"}


def _train(update: str, *, guarded: bool, steps: int) -> dict[str, np.ndarray]:
    """``steps`` compiled steps of GPT-2 small's program with ``update``, guarded or
    not; what a checkpoint would hold."""
    catalog = Catalog.load()
    program = Selection(str(EXAMPLES / "gpt2-small.sx"), sets=GPT2).compile(catalog)
    program = dataclasses.replace(
        program, run=dataclasses.replace(program.run, guard_finite=guarded)
    )
    choices = Target(device="cpu", lowering="compiled", requests={UPDATE: update})
    choices = choices.choices(program, None)
    trainer = lower(program, catalog, device="cpu", choices=choices).trainer
    assert trainer.choices[UPDATE] == update
    kind = type(trainer.updates[0][0])
    assert kind is (FusedUpdate if update == "fused" else CompiledUpdate)
    trainer.init_params()
    _, loader = open_loader(catalog, program.stages[0].data, program.run.seed)
    for step in range(1, steps + 1):
        trainer.commit(trainer.propose(loader.next_batch(), stage=0, step=step, lr=1e-2))
    params, states = trainer.export()
    return {**{f"p:{k}": v.copy() for k, v in params.items()}, **states}


def test_gpt2_smalls_program_updates_fused_as_the_graph_does(compile_quietly) -> None:
    counters.clear()
    # one step from the same parameters and gradients: within float tolerance of each
    # tensor's scale (bf16 compute: later steps' gradients would differ by more than
    # the updates' rounding). The tied table's gradient comes contiguous here (the
    # lookup's adds into the head's); a strided one is the test above.
    fused, graph = (_train(update, guarded=False, steps=1) for update in ("fused", "compiled"))
    for key, value in graph.items():
        scale = float(np.abs(value).max())
        np.testing.assert_allclose(
            fused[key], value, rtol=0, atol=1e-4 * scale + 1e-10, err_msg=key
        )
    # guarded (into copies) and unguarded (in place): the same bits
    unguarded, guarded = (_train("fused", guarded=g, steps=3) for g in (False, True))
    assert unguarded.keys() == guarded.keys()
    assert all(unguarded[k].tobytes() == guarded[k].tobytes() for k in unguarded)
    # the bf16 loss reached AOTAutograd's cache (sexpgpu_torch.cross_entropy: a custom
    # autograd function in the graph made the cache pass it by at every start)
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    assert sum(counters["aot_autograd"].values()) >= 1
