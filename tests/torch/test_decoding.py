"""A generator's key/value cache (sexpgpu_torch.decoding, docs/generate.md).

The cache's two functions are run here by hand over random sequences, position by
position (the prompt at once, then one position at a time), and their logits are
compared with the whole forward's at every position, for each way a stack and an
attention can be run; a graph that mixes positions otherwise than by causal
attention is left to the whole forward, and its records are still right.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

import sexpgpu_data
import sexpgpu_eval
import sexpgpu_local
import sexpgpu_torch
from sexpgpu.catalog import Catalog
from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float
from sexpgpu_torch.decoding import NotCached, compile_decoders, sequence_plan
from sexpgpu_torch.sampling import choose
from tests.catalogs import compile_text, lower, open_loader

P = 4  # (sort :length 3) prompts with three symbols and the separator


def source(forward: str, *, layers: str = "(layer block (transformer-block dim 2))") -> str:
    """A run of ``(sort :vocab 8 :length 3) :seq 8`` whose model has ``layers`` and
    ``forward``, and an eval pass that samples 4 tokens from it."""
    return f"""
(deflayer open-attention (dim heads)
  (layer q (linear dim dim)) (layer k (linear dim dim)) (layer v (linear dim dim))
  (forward (x) (attention (q x) (k x) (v x) :heads heads :causal false)))

(defmodel lm (vocab seq dim)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.5))
  {layers}
  (layer head (linear dim vocab))
  (forward (ids) {forward}))

(defdata prompts (sort :vocab 8 :length 3 :split "rl") :seq 8 :batch 4)

(defrun decode
  :model (lm 8 8 16)
  :optimizer (adam :lr 0.003)
  :seed 3
  :steps 1
  :data prompts
  :loss (cross-entropy (model inputs) targets)
  :evals ((eval sampled :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 2 :temperature 1.0)
           :metrics ((mean-reward (mean reward))))))
"""


STACKED = source(
    "(-> (+ (embed ids) pos) blocks head)",
    layers="(layer blocks (repeat 3 (transformer-block dim 2)))",
)

CACHED = {
    "one block": source("(head (block (+ (embed ids) pos)))"),
    "a stack": STACKED,
    "elementwise around it": source(
        "(head (tanh (* 0.5 (block (silu (+ (- (embed ids) 0.1) (* pos 2.0)))))))"
    ),
    "softmax over the width": source("(head (softmax (block (+ (embed ids) pos)) :axis 2))"),
    "a sum over the width": source(
        "(head (+ (block (+ (embed ids) pos)) (sum (embed ids) :axis 2 :keepdim true)))"
    ),
}

WHOLE = {
    "attention that is not causal": (
        source(
            "(head (attn (+ (embed ids) pos)))",
            layers="(layer attn (open-attention dim 2))",
        ),
        "attention that is not causal",
    ),
    "a mean over the sequence": (
        source("(head (block (+ (embed ids) (mean (embed ids) :axis 1 :keepdim true))))"),
        "mean works across the sequence axis",
    ),
    "a softmax over the sequence": (
        source("(head (block (softmax (+ (embed ids) pos) :axis 1)))"),
        "softmax works across the sequence axis",
    ),
    "a transpose": (
        source("(head (transpose (transpose (block (+ (embed ids) pos)) 1 2) 1 2))"),
        "transpose may mix the positions",
    ),
}


def sampler_of(trainer: Any) -> Any:
    return trainer.samplers["eval sampled"]


def whole_logits(trainer: Any, sequence: torch.Tensor) -> torch.Tensor:
    (out,) = trainer._run_quietly(sampler_of(trainer).logits, {"sequence": sequence})
    return out.float()


def cached_logits(trainer: Any, sequence: torch.Tensor) -> torch.Tensor:
    """The logits at every position from the prompt's last on, through the cache as
    the sampler runs it: the first ``P`` positions in one prefill, then each later
    one by a step."""
    sampler = sampler_of(trainer)
    records, seq = sequence.shape
    caches = sampler.cached.new_caches(records, seq, torch.device("cpu"))
    rows = [
        sampler._trip(sequence, last, last == P - 1, caches, seed=last)[0]
        for last in range(P - 1, seq)
    ]
    return torch.stack(rows, dim=1)


def whole_from_prompt(trainer: Any, sequence: torch.Tensor) -> torch.Tensor:
    """The whole forward's logits at the same positions as :func:`cached_logits`."""
    return whole_logits(trainer, sequence)[:, P - 1 :, :]


def random_sequences(seed: int) -> torch.Tensor:
    return torch.randint(0, 8, (6, 8), generator=torch.Generator().manual_seed(seed))


def assert_cache_gives_the_whole_forward(trainer: Any, seeds: range) -> None:
    """On random sequences from each of ``seeds``, the logits through the cache are the
    whole forward's, position by position, to rounding."""
    for seed in seeds:
        sequence = random_sequences(seed)
        torch.testing.assert_close(
            cached_logits(trainer, sequence),
            whole_from_prompt(trainer, sequence),
            atol=2e-5,
            rtol=0,
        )


@pytest.mark.parametrize("name", sorted(CACHED))
def test_the_cached_logits_are_the_whole_forwards_at_every_position(name: str) -> None:
    trainer = lower(compile_text(CACHED[name], "decode.sx"))
    trainer.init_params()
    assert sampler_of(trainer).cached is not None
    assert_cache_gives_the_whole_forward(trainer, range(3))


@pytest.mark.parametrize(
    "choose",
    [{"stack:model.blocks": kernel} for kernel in ("looped", "unrolled")],
    ids=lambda c: "+".join(c.values()),
)
def test_every_way_of_running_a_stack_caches_alike(choose: dict[str, str]) -> None:
    """The cache unrolls a stack whatever its kernel: each layer its own cache."""
    trainer = lower(compile_text(STACKED, "decode.sx"), choose=choose)
    trainer.init_params()
    cached = sampler_of(trainer).cached
    assert len(cached.caches) == 3  # one attention per layer
    assert_cache_gives_the_whole_forward(trainer, range(7, 8))


class FixedShapes:
    """The compiled strategy's way of reading a cache (whole, later positions masked),
    its functions run as they are."""

    fixed_shapes = True

    @staticmethod
    def evaluation(fn: Any) -> Any:
        return fn


def test_a_cache_read_whole_with_a_mask_gives_the_same_logits() -> None:
    """What the compiled lowering runs: every trip the same shapes."""
    program = compile_text(STACKED, "decode.sx")
    trainer = lower(program)
    trainer.init_params()
    sampler = sampler_of(trainer)
    logits = program.evals[0].generator.logits
    pick = partial(choose, gen=program.evals[0].generator)
    sampler.cached = compile_decoders(
        logits, trainer.ctx, {}, torch.device("cpu"), (), pick, FixedShapes()
    )
    assert sampler.cached.fixed_shapes
    assert_cache_gives_the_whole_forward(trainer, range(2))


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_graph_that_mixes_positions_runs_the_whole_forward(name: str) -> None:
    text, reason = WHOLE[name]
    program = compile_text(text, "decode.sx")
    gen = program.evals[0].generator
    with pytest.raises(NotCached, match=reason):
        sequence_plan(gen.logits)
    trainer = lower(program)
    trainer.init_params()
    sampler = sampler_of(trainer)
    assert sampler.cached is None
    batch = open_loader(program.evals[0].data, 3).next_batch()
    records = trainer.generate(gen, batch, seed=1, draw=("batch", 0), stopping=lambda: False)
    # each trip drew from the whole forward over the sequence as it was then (pad after)
    for trip in range(gen.new_tokens):
        then = records["sequence"].copy()
        then[:, P + trip :] = gen.pad
        row = whole_logits(trainer, torch.from_numpy(then))[:, P - 1 + trip, :]
        token = torch.from_numpy(records["completion"][:, trip])
        want = torch.log_softmax(row, dim=-1).gather(1, token[:, None])[:, 0]
        np.testing.assert_allclose(records["sampled-logp"][:, trip], want.numpy(), atol=1e-5)


def test_the_records_match_the_whole_forwards_draws() -> None:
    """Sampling through the cache draws the tokens the whole forward's logits give:
    the same noise over logits equal to rounding (a head sharp enough that rounding
    cannot move an argmax)."""
    program = compile_text(STACKED, "decode.sx")
    gen = program.evals[0].generator
    trainer = lower(program)
    trainer.init_params()
    weight = trainer.params["model.head.weight"].detach().numpy() * 50
    trainer.set_params({"model.head.weight": weight.astype(np.float32)})
    sampler = sampler_of(trainer)
    batch = open_loader(program.evals[0].data, 3).next_batch()

    def records() -> dict[str, np.ndarray]:
        return trainer.generate(gen, batch, seed=9, draw=("batch", 2), stopping=lambda: False)

    through_cache = records()
    cached, sampler.cached = sampler.cached, None
    try:
        whole = records()
    finally:
        sampler.cached = cached
    np.testing.assert_array_equal(through_cache["completion"], whole["completion"])
    np.testing.assert_allclose(through_cache["sampled-logp"], whole["sampled-logp"], atol=1e-4)
    assert through_cache["completion"].std() > 0  # not one token everywhere


# ---------------------------------------------------------------- a plugin's op


class SquashPlugin:
    """A plugin supplying ``squash`` (x / (1 + |x|)), position-wise or not by its spec."""

    def __init__(self, positionwise: bool) -> None:
        self.spec = OpSpec(
            "squash", "x / (1 + |x|)", same_float, (Arg("x"),), positionwise=positionwise
        )

    @hookimpl
    def sexpgpu_ops(self) -> list[OpInfo]:
        def build_torch() -> Any:
            return lambda attrs: lambda x: x / (1 + x.abs())

        return [OpInfo("squash", self.spec, {"torch": build_torch}, self.spec.doc)]


@pytest.mark.parametrize("positionwise", [True, False])
def test_a_plugins_op_is_cached_when_its_spec_says_positionwise(positionwise: bool) -> None:
    catalog = Catalog.of(
        {
            "torch": sexpgpu_torch,
            "data": sexpgpu_data,
            "eval": sexpgpu_eval,
            "local": sexpgpu_local,
            "squash": SquashPlugin(positionwise),
        }
    )
    from sexpgpu import lang

    text = source("(head (block (squash (+ (embed ids) pos))))")
    program = lang.compile_text(text, "decode.sx", catalog=catalog)
    trainer = lower(program, catalog=catalog)
    trainer.init_params()
    sampler = sampler_of(trainer)
    if not positionwise:
        assert sampler.cached is None
        return
    assert sampler.cached is not None
    assert_cache_gives_the_whole_forward(trainer, range(4, 5))


def test_the_prefill_runs_its_ops_past_the_last_attention_at_the_last_position_alone() -> None:
    # the head over every prompt position would make a vocabulary's worth of logits
    # per position, all but the last thrown away
    from torch.utils._python_dispatch import TorchDispatchMode

    trainer = lower(compile_text(STACKED, "decode.sx"))
    trainer.init_params()
    head = trainer.params["model.head.weight"]
    rows: list[int] = []

    class HeadRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, torch.Tensor) and a.data_ptr() == head.data_ptr() for a in args):
                rows.append(args[0].numel() // head.shape[0])
            return func(*args, **(kwargs or {}))

    sequence = random_sequences(0)
    with HeadRows():
        prefilled = cached_logits(trainer, sequence)[:, 0]
    records = sequence.shape[0]
    assert rows[0] == records  # the prefill: one position a record, not the prompt's P
    assert rows == [records] * len(rows)  # and each later trip's one position
    torch.testing.assert_close(
        prefilled, whole_from_prompt(trainer, sequence)[:, 0], atol=2e-5, rtol=0
    )
