"""Each trip of a generator draws from its own seed (docs/generate.md): the seed of trip
``t`` of step ``s`` is ``(seed, "generate", where, "step", s, t)``, and on several ranks
``(seed, "generate", where, "step", s, "rank", r, t)``.

The draws are watched where the sampler makes them (each trip's uniform noise and the
seed it came from) while the trainer samples as a run's step does: alone, and joined as
each rank of two. The seeds are recomputed here from (seed, step, rank, trip), each
noise is recomputed from its seed, and no two trips, ranks or steps share a draw. Then
what a user would see: the tokens a record makes do not repeat from trip to trip, and
two ranks given the same prompts sample other tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from sexpgpu_torch import sampling
from sexpgpu_torch.rng import derive_seed
from tests.catalogs import RankOf, compile_text, lower, open_loader

SEED, TRIPS, SAMPLES, VOCAB = 9, 3, 4, 8
SOURCE = f"""
(defmodel gpt (vocab seq dim)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (layer block (transformer-block dim 2))
  (layer head (linear dim vocab))
  (forward (ids) (head (block (+ (embed ids) pos)))))

(defdata prompts (sort :vocab {VOCAB} :length 3 :split "rl") :seq 8 :batch 4)

(defrun drawing
  :model (gpt {VOCAB} 8 16)
  :optimizer (adam :lr 0.003)
  :seed {SEED}
  :steps 2
  :data prompts
  :generate (sample model :new-tokens {TRIPS} :samples {SAMPLES} :temperature 1.0)
  :loss (neg (mean (* reward (sum (* (gather (log-softmax (model sequence)) next) next-mask) :axis 1)))))
"""


@pytest.fixture(scope="module")
def program() -> Any:
    return compile_text(SOURCE, "drawing.sx")


@pytest.fixture(scope="module")
def prompts(program: Any) -> dict[str, np.ndarray]:
    return open_loader(program.stages[0].data, program.run.seed).next_batch()


def sampling_trainer(program: Any, rank: int | None) -> Any:
    """A trainer with the drawn parameters (every logit within 0.01 of the others, so
    each token is decided by its draw), alone or as ``rank`` of two."""
    trainer = lower(program)
    trainer.init_params()
    if rank is not None:
        trainer.use_group(RankOf(rank))
    return trainer


def draws_of(
    monkeypatch: pytest.MonkeyPatch,
    program: Any,
    prompts: dict[str, np.ndarray],
    *,
    step: int,
    rank: int | None,
) -> tuple[list[tuple[int, torch.Tensor]], dict[str, np.ndarray]]:
    """Step ``step``'s generation as ``rank`` (``None``: alone): each trip's seed and
    noise, as the sampler made them, and the records."""
    seen: list[tuple[int, torch.Tensor]] = []
    made_by_sampler = sampling.Sampler._noise

    def watched(sampler: Any, shape: tuple[int, ...], seed: int) -> torch.Tensor | None:
        noise = made_by_sampler(sampler, shape, seed)
        assert noise is not None  # temperature 1: every trip draws
        seen.append((seed, noise.clone()))
        return noise

    monkeypatch.setattr(sampling.Sampler, "_noise", watched)
    trainer = sampling_trainer(program, rank)
    records = trainer.generate(
        program.stages[0].generator,
        prompts,
        seed=program.run.seed,
        draw=("step", step),
        stopping=lambda: False,
    )
    monkeypatch.setattr(sampling.Sampler, "_noise", made_by_sampler)
    assert records is not None
    return seen, records


def trip_seed(where: str, step: int, rank: int | None, trip: int) -> int:
    """The documented seed of one trip, from the run's seed, the step, the rank, the trip."""
    ranked = () if rank is None else ("rank", rank)
    return derive_seed(SEED, "generate", where, "step", step, *ranked, trip)


def test_each_trip_draws_from_the_seed_of_its_step_rank_and_trip(
    monkeypatch, program, prompts
) -> None:
    where = program.stages[0].generator.name
    records_n = len(prompts["inputs"]) * SAMPLES
    every_noise: dict[tuple[int, int | None, int], bytes] = {}
    for step in (1, 2):
        for rank in (None, 0, 1):
            seen, _ = draws_of(monkeypatch, program, prompts, step=step, rank=rank)
            assert [seed for seed, _ in seen] == [
                trip_seed(where, step, rank, trip) for trip in range(TRIPS)
            ], f"step {step}, rank {rank}"
            for trip, (seed, noise) in enumerate(seen):
                want = torch.rand((records_n, VOCAB), generator=torch.Generator().manual_seed(seed))
                assert torch.equal(noise, want), f"step {step}, rank {rank}, trip {trip}"
                every_noise[(step, rank, trip)] = noise.numpy().tobytes()
    # no two (step, rank, trip) share a draw
    assert len(set(every_noise.values())) == len(every_noise) == 2 * 3 * TRIPS


def test_a_record_makes_other_tokens_at_each_trip(monkeypatch, program, prompts) -> None:
    """Every logit within 0.01 of the others: each token is its draw's. With a draw of
    its own per trip a record repeats one token all the way with odds of 8**-2 (about
    one record in the 16); trips sharing a draw would make nearly every record repeat."""
    _, records = draws_of(monkeypatch, program, prompts, step=1, rank=None)
    completion = records["completion"]
    assert completion.shape == (len(prompts["inputs"]) * SAMPLES, TRIPS)
    repeating = (completion == completion[:, :1]).all(axis=1)
    assert int(repeating.sum()) <= 3, completion


def test_two_ranks_given_the_same_prompts_sample_other_tokens(
    monkeypatch, program, prompts
) -> None:
    completions = [
        draws_of(monkeypatch, program, prompts, step=1, rank=rank)[1]["completion"]
        for rank in (None, 0, 1)
    ]
    alone, first, second = completions
    assert not np.array_equal(first, second)
    assert not np.array_equal(alone, first) and not np.array_equal(alone, second)
