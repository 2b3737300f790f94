"""A generator's trips on the torch trainer (sexpgpu_torch.sampling, docs/generate.md).

One tiny program (``sort :vocab 8 :length 3``, ``:seq 8``, a one-block transformer of
width 16) is compiled once; its stage and eval passes hold generators of different
options, each sampled through ``TorchTrainer.generate`` in this process. The model's
logits are recomputed here through the generator's own logits graph (what the root
gives on the final ``sequence``; a causal model gives at each position what it gave
at that trip) or through a compiled eval pass, and each record is checked against them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import sexpgpu_torch.sampling as sampling
from sexpgpu_data.generated import seqtask_verify
from sexpgpu_torch.sampling import _nucleus
from tests.catalogs import compile_text, lower, open_loader

STOP = 7  # sort :vocab 8 pads with 7 (6 is the separator)
P = 4  # sort :length 3 prompts with the three symbols and the separator
VOCAB = 8

SOURCE = """
(defmodel gpt (vocab seq dim)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (layer block (transformer-block dim 2))
  (layer head (linear dim vocab))
  (forward (ids) (head (block (+ (embed ids) pos)))))

(defdata prompts (sort :vocab 8 :length 3 :split "rl") :seq 8 :batch 4)

(defrun sampler
  :model (gpt 8 8 16)
  :optimizer (adam :lr 0.003)
  :seed 5
  :steps 1
  :data prompts
  :generate (sample model :new-tokens 3 :samples 4 :temperature 1.0)
  :loss (neg (mean (* reward (sum (* (gather (log-softmax (model sequence)) next) next-mask) :axis 1))))
  :evals ((eval twin :every 1 :data prompts
           :generate (sample model :new-tokens 3 :samples 4 :temperature 1.0)
           :metrics ((mean-reward (mean reward))))
          (eval scored :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 4 :temperature 1.0 :stop 7)
           :metrics ((made (sum (* (gather (log-softmax (model sequence)) next) next-mask)))
                     (sampled (sum sampled-logp))))
          (eval greedy :every 1 :data prompts
           :generate (sample model :new-tokens 3 :samples 2 :temperature 0)
           :metrics ((mean-reward (mean reward))))
          (eval greedy4 :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 2 :temperature 0)
           :metrics ((mean-reward (mean reward))))
          (eval stopped :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 2 :temperature 0 :stop 7)
           :metrics ((mean-reward (mean reward))))
          (eval hot :every 1 :data prompts
           :generate (sample model :new-tokens 3 :samples 2 :temperature 2.5 :top-k 1)
           :metrics ((mean-reward (mean reward))))
          (eval cold :every 1 :data prompts
           :generate (sample model :new-tokens 3 :samples 2 :temperature 0.3 :top-k 1)
           :metrics ((mean-reward (mean reward))))
          (eval top3 :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 8 :temperature 1.5 :top-k 3)
           :metrics ((mean-reward (mean reward))))
          (eval nucleus :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 8 :temperature 0.8 :top-p 0.6)
           :metrics ((mean-reward (mean reward))))
          (eval whole :every 1 :data prompts
           :generate (sample model :new-tokens 3 :samples 2 :temperature 1.0 :top-p 1.0 :stop 7)
           :metrics ((mean-reward (mean reward))))
          (eval lengths :every 1 :data prompts
           :generate (sample model :new-tokens 4 :samples 4 :stop 7
                      :reward (sum completion-mask :axis 1))
           :metrics ((mean-reward (mean reward))))
          (eval scaled :every 1 :data prompts
           :generate (sample model :new-tokens 3 :samples 2
                      :reward (+ (* 2 (sum sampled-logp :axis 1)) (cast (sum completion :axis 1) f32)))
           :metrics ((mean-reward (mean reward))))))
"""

Records = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def program() -> Any:
    return compile_text(SOURCE, "sampling.sx")


@pytest.fixture(scope="module")
def batches(program: Any) -> list[dict[str, np.ndarray]]:
    loader = open_loader(program.stages[0].data, program.run.seed)
    return [loader.next_batch() for _ in range(3)]


def generator(program: Any, name: str) -> Any:
    """The generator named ``name`` (``stage main``, ``eval greedy``...)."""
    found = [s.generator for s in program.stages] + [e.generator for e in program.evals]
    return next(g for g in found if g is not None and g.name == name)


def trainer_for(program: Any, *, sharp: bool = True, stop_bias: float = 0.0) -> Any:
    """A trainer lowered afresh with its parameters drawn; ``sharp`` widens the head
    (the drawn model's logits are all within 0.01 of each other, so that ranks and
    argmaxes would hang on rounding); ``stop_bias`` is added to the stop token's logit."""
    trainer = lower(program)
    trainer.init_params()
    head = {}
    if sharp:
        head["model.head.weight"] = (
            trainer.params["model.head.weight"].detach().numpy() * 600
        ).astype(np.float32)
    if stop_bias:
        bias = np.zeros(VOCAB, dtype=np.float32)
        bias[STOP] = stop_bias
        head["model.head.bias"] = bias
    if head:
        trainer.set_params(head)
    return trainer


def generate(
    trainer: Any,
    gen: Any,
    batch: dict[str, np.ndarray],
    *,
    seed: int = 11,
    draw: tuple = ("step", 1),
    stopping: Callable[[], bool] = lambda: False,
) -> Records | None:
    return trainer.generate(gen, batch, seed=seed, draw=draw, stopping=stopping)


def logits_of(trainer: Any, gen: Any, sequence: np.ndarray) -> np.ndarray:
    """The root's logits ``[records, seq, vocab]`` on ``sequence``, as the sampler runs them."""
    sampler = trainer.samplers[gen.name]
    (out,) = trainer._run_quietly(sampler.logits, {"sequence": torch.from_numpy(sequence)})
    return out.float().numpy()


def step_logits(trainer: Any, gen: Any, records: Records) -> np.ndarray:
    """``[records, new_tokens, vocab]``: the logits each trip drew its token from."""
    full = logits_of(trainer, gen, records["sequence"])
    p, n = gen.prompt_length, gen.new_tokens
    return full[:, p - 1 : p - 1 + n, :]


def log_softmax(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x).double(), dim=-1).numpy()


def chosen(values: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.take_along_axis(values, tokens[..., None], axis=-1)[..., 0]


def assert_same_records(a: Records, b: Records) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), f"{key} differs"


def count_trips(monkeypatch: pytest.MonkeyPatch, trainer: Any, gen: Any) -> list[int]:
    """A one-element counter of the trips of ``gen`` from now on (the runs of its
    logits graph, or of its key/value cache's functions)."""
    sampler = trainer.samplers[gen.name]
    calls = [0]
    run_graph = sampler.run_graph
    cached = sampler.cached
    trips = (sampler.logits,) + ((cached.prefill, cached.step) if cached else ())

    def counting(fn: Any, inputs: Any) -> Any:
        if any(fn is trip for trip in trips):
            calls[0] += 1
        return run_graph(fn, inputs)

    monkeypatch.setattr(sampler, "run_graph", counting)
    return calls


def first_stops(records: Records, n: int) -> np.ndarray:
    """Per record: the trip that made the stop token, or ``n`` when none did."""
    is_stop = records["completion"] == STOP
    return np.where(is_stop.any(axis=1), is_stop.argmax(axis=1), n)


# ---------------------------------------------------------------- 1. determinism


def test_the_same_seed_and_draw_give_the_same_records(program, batches) -> None:
    gen = generator(program, "stage main")
    first = trainer_for(program, sharp=False)  # as drawn: every logit within 0.01
    a = generate(first, gen, batches[0])
    b = generate(first, gen, batches[0])
    c = generate(trainer_for(program, sharp=False), gen, batches[0])
    assert_same_records(a, b)
    assert_same_records(a, c)


def test_another_draw_seed_or_generator_gives_other_completions(program, batches) -> None:
    """At temperature 1 on the drawn model every token is close to uniform over 8, so
    two of these 16 records x 3 tokens agree everywhere with odds near 8**-48."""
    trainer = trainer_for(program, sharp=False)
    gen = generator(program, "stage main")
    base = generate(trainer, gen, batches[0])["completion"]
    others = [
        generate(trainer, gen, batches[0], draw=("step", 2))["completion"],
        generate(trainer, gen, batches[0], draw=("batch", 1))["completion"],
        generate(trainer, gen, batches[0], seed=12)["completion"],
        # the same options under another name: the name keys the draws too
        generate(trainer, generator(program, "eval twin"), batches[0])["completion"],
    ]
    for other in others:
        assert not np.array_equal(base, other)
    # and a draw is not one token for all records
    assert len(np.unique(base)) > 2


def test_generating_leaves_the_batch_as_it_was(program, batches) -> None:
    trainer = trainer_for(program)
    batch = {k: v.copy() for k, v in batches[0].items()}
    generate(trainer, generator(program, "eval lengths"), batch)
    for key in batches[0]:
        assert np.array_equal(batch[key], batches[0][key])


# ---------------------------------------------------------------- 2. layout


@pytest.mark.parametrize(
    "name",
    ["stage main", "eval scored", "eval greedy", "eval top3", "eval nucleus", "eval whole"],
)
def test_the_records_are_laid_out_as_documented(program, batches, name) -> None:
    gen = generator(program, name)
    trainer = trainer_for(program, stop_bias=1.5)
    p, n, g = gen.prompt_length, gen.new_tokens, gen.samples
    assert p == P
    pad = STOP if gen.stop is not None else 0
    temperature = gen.temperature or 1.0
    for batch in batches:
        records = generate(trainer, gen, batch)
        assert set(records) == set(gen.fields)
        for key, t in gen.fields.items():
            assert records[key].shape == tuple(t.shape), key
            assert records[key].dtype == {"i64": np.int64, "f32": np.float32}[t.dtype], key
        for key, array in batch.items():
            assert np.array_equal(records[key], np.repeat(array, g, axis=0)), key
        seq, completion, mask = (
            records["sequence"],
            records["completion"],
            records["completion-mask"],
        )
        assert np.array_equal(records["prompt"], records["inputs"][:, :p])
        assert np.array_equal(seq[:, :p], records["prompt"])
        assert np.array_equal(seq[:, p : p + n], completion)
        assert (seq[:, p + n :] == pad).all()
        assert np.array_equal(records["next"][:, :-1], seq[:, 1:])
        assert np.array_equal(records["next-mask"][:, p - 1 : p - 1 + n], mask)
        outside = np.ones(seq.shape, dtype=bool)
        outside[:, p - 1 : p - 1 + n] = False
        assert (records["next-mask"][outside] == 0).all()
        assert set(np.unique(mask)) <= {0.0, 1.0}
        assert (completion >= 0).all() and (completion < VOCAB).all()
        logp = records["sampled-logp"]
        assert (logp[mask == 0] == 0).all()
        want = chosen(log_softmax(step_logits(trainer, gen, records) / temperature), completion)
        np.testing.assert_allclose(logp[mask == 1], want[mask == 1], atol=1e-5, rtol=0)
        assert (logp[mask == 1] < 0).all()


def test_the_records_score_as_the_loss_formula_says(program, batches) -> None:
    """``(gather (log-softmax (model sequence)) next)`` times ``next-mask``, summed, in a
    compiled eval pass on the records: the sum of ``sampled-logp`` (temperature 1)."""
    trainer = trainer_for(program, stop_bias=1.5)
    gen = generator(program, "eval scored")
    for batch in batches:
        records = generate(trainer, gen, batch)
        numbers = trainer.evaluate("scored", records)
        assert numbers["sampled"] == pytest.approx(float(records["sampled-logp"].sum()), abs=1e-4)
        assert numbers["made"] == pytest.approx(numbers["sampled"], abs=1e-4)


# ---------------------------------------------------------------- 3. stop token


def test_a_record_that_stops_makes_only_the_masked_stop_token(
    program, batches, monkeypatch
) -> None:
    """A stop token about as likely as the rest together: records stop at every trip,
    some never, and some draws end before the last trip."""
    gen = generator(program, "eval scored")
    n = gen.new_tokens
    trainer = trainer_for(program, stop_bias=2.0)
    trips = count_trips(monkeypatch, trainer, gen)
    seen_stops: set[int] = set()
    ran: set[int] = set()
    for draw in range(8):
        for batch in batches:
            trips[0] = 0
            records = generate(trainer, gen, batch, draw=("step", draw))
            completion, mask = records["completion"], records["completion-mask"]
            logp = records["sampled-logp"]
            stops = first_stops(records, n)
            for r, f in enumerate(stops):
                assert (mask[r, : f + 1] == 1).all()  # up to and with the stop token
                assert (mask[r, f + 1 :] == 0).all()
                assert (completion[r, f + 1 :] == STOP).all()
                assert (logp[r, f + 1 :] == 0).all()
                assert (completion[r, :f] != STOP).all()
            # the trips end once every record has stopped
            assert trips[0] == min(n, int(np.minimum(stops, n - 1).max()) + 1)
            seen_stops.update(stops.tolist())
            ran.add(trips[0])
    assert seen_stops == set(range(n + 1))  # at each trip, and never
    assert min(ran) < n and n in ran  # some draws ended early, some did not


def test_when_every_record_stops_the_trips_end_and_the_records_are_whole(
    program, batches, monkeypatch
) -> None:
    """With the stop token the likeliest everywhere, greedy sampling stops every record
    at its first token: one trip, and records as those of the same sampling without
    :stop (which runs all four trips), but masked after the first token."""
    trainer = trainer_for(program, stop_bias=50.0)
    gen, whole = generator(program, "eval stopped"), generator(program, "eval greedy4")
    n = gen.new_tokens
    trips = count_trips(monkeypatch, trainer, gen)
    full_trips = count_trips(monkeypatch, trainer, whole)
    for batch in batches:
        trips[0] = full_trips[0] = 0
        records = generate(trainer, gen, batch)
        reference = generate(trainer, whole, batch)
        assert trips[0] == 1 and full_trips[0] == n
        assert (reference["completion"] == STOP).all()  # all trips ran: the stop each time
        mask = np.zeros_like(reference["completion-mask"])
        mask[:, 0] = 1
        assert np.array_equal(records["completion-mask"], mask)
        for key in ("completion", "sequence", "prompt", "inputs", "targets", "reward"):
            assert records[key].tobytes() == reference[key].tobytes(), key
        # past the sequence's end `next` holds the pad: the stop token here, 0 there
        assert np.array_equal(records["next"][:, :-1], reference["next"][:, :-1])
        assert records["sampled-logp"].tobytes() == (reference["sampled-logp"] * mask).tobytes()
        next_mask = np.zeros_like(reference["next-mask"])
        next_mask[:, P - 1] = 1
        assert np.array_equal(records["next-mask"], next_mask)


# ---------------------------------------------------------------- 4. greedy


def test_temperature_zero_takes_the_likeliest_token(program, batches) -> None:
    trainer = trainer_for(program)
    for name in ("eval greedy", "eval greedy4"):
        gen = generator(program, name)
        for batch in batches:
            records = generate(trainer, gen, batch)
            logits = step_logits(trainer, gen, records)
            assert np.array_equal(records["completion"], logits.argmax(axis=-1))
            assert (records["completion-mask"] == 1).all()
            want = chosen(log_softmax(logits), records["completion"])  # at temperature 1
            np.testing.assert_allclose(records["sampled-logp"], want, atol=1e-5, rtol=0)
            # the same whatever the draw: there is nothing to draw
            again = generate(trainer, gen, batch, seed=99, draw=("batch", 7))
            assert_same_records(records, again)
            # each prompt's samples are the same
            pairs = records["completion"].reshape(-1, gen.samples, gen.new_tokens)
            assert (pairs == pairs[:, :1]).all()


# ---------------------------------------------------------------- 5. top-k


@pytest.mark.parametrize("name", ["eval hot", "eval cold"])
def test_top_k_one_is_greedy_at_any_temperature(program, batches, name) -> None:
    trainer = trainer_for(program)
    gen, greedy = generator(program, name), generator(program, "eval greedy")
    for batch in batches:
        want = generate(trainer, greedy, batch)
        for draw in range(3):
            records = generate(trainer, gen, batch, draw=("step", draw))
            assert np.array_equal(records["completion"], want["completion"])
            assert np.array_equal(records["sequence"], want["sequence"])
            # its log-probability is at the generator's temperature, before top-k
            logits = step_logits(trainer, gen, records)
            scaled = chosen(log_softmax(logits / gen.temperature), records["completion"])
            np.testing.assert_allclose(records["sampled-logp"], scaled, atol=1e-5, rtol=0)


def test_top_k_picks_among_the_k_largest_logits_only(program, batches) -> None:
    trainer = trainer_for(program)
    gen = generator(program, "eval top3")
    k = gen.top_k
    ranks: list[np.ndarray] = []
    for draw in range(12):
        for batch in batches:
            records = generate(trainer, gen, batch, draw=("step", draw))
            logits = step_logits(trainer, gen, records)
            picked = chosen(logits, records["completion"])
            kth = np.sort(logits, axis=-1)[..., -k]
            assert (picked >= kth - 1e-5).all()
            ranks.append((logits > picked[..., None]).sum(axis=-1).ravel())
    counts = np.bincount(np.concatenate(ranks), minlength=VOCAB)
    assert (counts[:k] > 0).all()  # it samples: not only the likeliest
    assert (counts[k:] == 0).all()


def test_top_p_picks_within_the_nucleus(program, batches) -> None:
    trainer = trainer_for(program)
    gen = generator(program, "eval nucleus")
    outside_likeliest = 0
    for draw in range(12):
        for batch in batches:
            records = generate(trainer, gen, batch, draw=("step", draw))
            logits = step_logits(trainer, gen, records) / gen.temperature
            probs = torch.softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
            picked = chosen(probs, records["completion"])
            # the mass of the tokens likelier than the one picked is below top-p
            before = np.where(probs > picked[..., None] + 1e-6, probs, 0).sum(axis=-1)
            assert (before < gen.top_p + 1e-5).all()
            outside_likeliest += int((before > 0).sum())
    assert outside_likeliest > 0  # it samples: not only the likeliest


def test_top_p_one_leaves_the_nucleus_out(program, batches, monkeypatch) -> None:
    def refused(*_: Any) -> Any:
        raise AssertionError("top-p 1.0 narrowed the choice")

    monkeypatch.setattr(sampling, "_nucleus", refused)
    trainer = trainer_for(program)
    records = generate(trainer, generator(program, "eval whole"), batches[0])
    assert records is not None


# ---------------------------------------------------------------- 6. _nucleus


def kept(logits: list[list[float]], top_p: float) -> list[list[int]]:
    out = _nucleus(torch.tensor(logits, dtype=torch.float32), top_p)
    return [[i for i, v in enumerate(row) if v != float("-inf")] for row in out.tolist()]


def probs_logits(*probs: float) -> list[float]:
    return [float(np.log(p)) for p in probs]


def test_nucleus_keeps_the_smallest_likeliest_set_reaching_top_p() -> None:
    row = probs_logits(0.1, 0.6, 0.3)
    assert kept([row], 0.05) == [[1]]
    assert kept([row], 0.5) == [[1]]
    assert kept([row], 0.65) == [[1, 2]]
    assert kept([row], 0.85) == [[1, 2]]
    assert kept([row], 0.95) == [[0, 1, 2]]
    # rows are independent
    other = probs_logits(0.5, 0.2, 0.2, 0.1)
    assert kept([row + [-30.0], other], 0.65) == [[1, 2], [0, 1]]


def test_nucleus_keeps_the_kept_logits_as_they_were() -> None:
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5]])
    out = _nucleus(logits, 0.7)
    assert out[0, 1] == 2.0 and out[0, 3] == 1.5
    assert out[0, 0] == float("-inf") and out[0, 2] == float("-inf")


def test_nucleus_always_keeps_the_likeliest() -> None:
    assert kept([[0.0, 5.0, 1.0]], 1e-6) == [[1]]
    assert kept([[0.0, 0.0, 0.0, 0.0]], 1e-6) == [[0]]
    assert kept([[-1.0, 3.0, 3.0, 0.0]], 1e-6) == [[1]]


def test_nucleus_breaks_ties_in_token_order() -> None:
    # four tokens of 1/4: half the mass is the first two
    assert kept([[0.0, 0.0, 0.0, 0.0]], 0.5) == [[0, 1]]
    assert kept([[0.0, 0.0, 0.0, 0.0]], 0.3) == [[0, 1]]
    assert kept([[0.0, 0.0, 0.0, 0.0]], 0.2) == [[0]]
    # equal likeliest tokens, and equal tokens after them
    assert kept([[1.0, 3.0, 1.0, 3.0, 1.0]], 0.5) == [[1, 3]]
    assert kept([[1.0, 3.0, 1.0, 3.0, 1.0]], 0.3) == [[1]]
    ties = probs_logits(0.2, 0.4, 0.2, 0.2)
    assert kept([ties], 0.5) == [[0, 1]]
    assert kept([ties], 0.7) == [[0, 1, 2]]


def test_nucleus_leaves_what_top_k_removed_out() -> None:
    inf = float("-inf")
    assert kept([[inf, 1.0, inf, 1.0]], 0.99) == [[1, 3]]
    assert kept([[inf, 1.0, inf, 1.0]], 0.4) == [[1]]


def test_nucleus_at_one_keeps_every_token() -> None:
    assert kept([[0.0, 5.0, 1.0, -2.0], [1.0, 1.0, 1.0, 1.0]], 1.0) == [[0, 1, 2, 3]] * 2


def test_nucleus_matches_a_float64_reference_on_random_logits() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, size=(64, 9)).astype(np.float32)
    probs = torch.softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    checked = 0
    for top_p in (0.1, 0.3, 0.5, 0.7, 0.9, 0.99):
        got = kept(logits.tolist(), top_p)
        for row, p, have in zip(logits, probs, got, strict=True):
            order = sorted(range(len(row)), key=lambda i: (-row[i], i))
            before = np.cumsum([p[i] for i in order]) - [p[i] for i in order]
            if np.min(np.abs(before - top_p)) < 1e-5:
                continue  # too close to call in float32
            want = sorted(i for i, b in zip(order, before, strict=True) if b < top_p)
            assert have == want
            checked += 1
    assert checked > 300


# ---------------------------------------------------------------- 7. abandoning


@pytest.mark.parametrize("name", ["stage main", "eval scored"])
def test_a_stop_before_a_trip_abandons_the_records(program, batches, monkeypatch, name) -> None:
    gen = generator(program, name)
    n = gen.new_tokens
    trainer = trainer_for(program, stop_bias=-50.0)  # no record stops early
    trips = count_trips(monkeypatch, trainer, gen)
    asked = [0]

    def never() -> bool:
        asked[0] += 1
        return False

    assert generate(trainer, gen, batches[0], stopping=never) is not None
    assert asked[0] == n and trips[0] == n
    for k in range(1, n + 1):
        trips[0] = asked[0] = 0

        def stop_at_k(k: int = k) -> bool:
            asked[0] += 1
            return asked[0] >= k

        assert generate(trainer, gen, batches[0], stopping=stop_at_k) is None
        assert asked[0] == k  # asked before each trip, and not again once it said stop
        assert trips[0] == k - 1  # no trip after the check that said stop
    # and an abandoned draw leaves nothing behind: the same records after it
    first = generate(trainer, gen, batches[1])
    generate(trainer, gen, batches[1], stopping=lambda: True)
    assert_same_records(first, generate(trainer, gen, batches[1]))


def test_a_stop_once_every_record_has_stopped_keeps_the_records(program, batches) -> None:
    """Nothing is left to make once every record has made its stop token: a signal then
    does not throw the records away (as a signal during the last trip does not)."""
    trainer = trainer_for(program, stop_bias=50.0)  # every record stops at its first token
    gen = generator(program, "eval stopped")
    asked = [0]

    def after_the_first_trip() -> bool:
        asked[0] += 1
        return asked[0] > 1

    records = generate(trainer, gen, batches[0], stopping=after_the_first_trip)
    assert records is not None and asked[0] == 1
    assert_same_records(records, generate(trainer, gen, batches[0]))


# ---------------------------------------------------------------- 8. reward


def test_without_reward_the_data_source_verifies(program, batches) -> None:
    trainer = trainer_for(program)
    best = 0.0
    for name in ("stage main", "eval greedy", "eval top3"):
        gen = generator(program, name)
        data = next(
            d.data
            for d in [*program.stages, *program.evals]
            if getattr(d, "generator", None) is gen
        )
        for draw in range(4):
            for batch in batches:
                records = generate(trainer, gen, batch, draw=("step", draw))
                want = seqtask_verify(data.options, data.seq, records)
                assert records["reward"].dtype == np.float32
                assert np.array_equal(records["reward"], want)
                best = max(best, float(want.max()))
    assert best > 0  # some answers are partly right: the comparison is not of zeros


def test_a_reward_expression_gives_each_record_its_value(program, batches) -> None:
    trainer = trainer_for(program, stop_bias=1.5)
    lengths, scaled = generator(program, "eval lengths"), generator(program, "eval scaled")
    assert lengths.verify is None and lengths.reward is not None
    seen: set[float] = set()
    for draw in range(3):
        for batch in batches:
            records = generate(trainer, lengths, batch, draw=("step", draw))
            assert records["reward"].dtype == np.float32
            assert np.array_equal(records["reward"], records["completion-mask"].sum(axis=1))
            seen.update(records["reward"].tolist())
            records = generate(trainer, scaled, batch, draw=("step", draw))
            want = 2 * records["sampled-logp"].sum(axis=1) + records["completion"].sum(axis=1)
            np.testing.assert_allclose(records["reward"], want, atol=1e-5, rtol=0)
    assert len(seen) > 1  # the lengths differ between records


class _Rank:
    """Rank ``rank`` of two as the trainer sees it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.size = rank, 2


@pytest.mark.parametrize("rank", [0, 1])
def test_each_of_two_ranks_makes_the_records_of_its_own_prompts(program, batches, rank) -> None:
    gen = generator(program, "stage main")
    trainer = trainer_for(program, sharp=False)
    trainer.use_group(_Rank(rank))
    # the run hands a rank its part of the step's prompts: each sampled gen.samples
    # times, with draws of its own (the rank joins the draw)
    share = len(batches[0]["inputs"]) // 2
    half = {name: array[rank * share : (rank + 1) * share] for name, array in batches[0].items()}
    mine = generate(trainer, gen, half)
    assert len(mine["completion"]) == share * 4
    alone = generate(trainer_for(program, sharp=False), gen, half, draw=("step", 1, "rank", rank))
    assert_same_records(mine, alone)
    plain = generate(trainer_for(program, sharp=False), gen, half)
    assert not np.array_equal(plain["sampled-logp"], mine["sampled-logp"])
    # an eval pass's generator makes whole batches (the ranks share out batches instead)
    whole = generate(trainer, generator(program, "eval twin"), batches[0], draw=("batch", 0))
    assert len(whole["completion"]) == len(batches[0]["inputs"]) * 4
