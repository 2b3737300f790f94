"""A generator's trips (docs/generate.md): one new token for every record per trip.

A trip reads the root's logits at the last written position. When the root's graph
allows a key/value cache (:mod:`sexpgpu_torch.decoding`), the first trip runs it over
the prompt and each later one over the one token written last; otherwise each trip
runs the root over the whole sequence so far. The
draw of trip ``t`` takes a ``torch.Generator`` seeded from ``(seed, "generate",
name, *draw, t)`` (Gumbel noise over the filtered logits), so the same step or pass
samples the same tokens in any process. A record that has made its stop token makes
only the pad after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from sexpgpu.lang.ir import Generator
from sexpgpu_torch.decoding import NOISE, POSITIONS, TOKENS, Decoders
from sexpgpu_torch.dtypes import TORCH_DTYPES
from sexpgpu_torch.rng import derive_seed
from sexpgpu_torch.strategy import GraphFn

Tensor = torch.Tensor


class Sampler:
    """Runs one :class:`~sexpgpu.lang.ir.Generator` on a trainer's parameters: ``logits``
    and ``reward`` are its graphs as the strategy runs them, ``cached`` the logits
    graph's decoding functions with a key/value cache (``None``: the graph allows
    none); ``run_graph`` runs one on given inputs with no gradients (the trainer's
    context, autocast and device)."""

    def __init__(
        self,
        gen: Generator,
        logits: GraphFn,
        reward: GraphFn | None,
        run_graph: Callable[[GraphFn, Mapping[str, Tensor]], list[Tensor]],
        device: torch.device,
        cached: Decoders | None = None,
    ) -> None:
        self.gen, self.logits, self.reward, self.cached = gen, logits, reward, cached
        self.run_graph, self.device = run_graph, device

    def records(
        self,
        batch: Mapping[str, np.ndarray],
        *,
        seed: int,
        draw: tuple[Any, ...],
        stopping: Callable[[], bool],
    ) -> dict[str, np.ndarray] | None:
        """The records of ``batch``'s prompts, or ``None`` when ``stopping()`` holds
        before a trip (the records are abandoned)."""
        gen, dev = self.gen, self.device
        seq_len = gen.fields["sequence"].shape[1]
        p, n, pad = gen.prompt_length, gen.new_tokens, gen.pad
        repeated = {k: np.repeat(np.asarray(v), gen.samples, axis=0) for k, v in batch.items()}
        records_n = len(repeated["inputs"])  # the batch's, or a rank's part of it
        prompt = torch.from_numpy(np.ascontiguousarray(repeated["inputs"][:, :p])).to(dev)
        sequence = torch.full((records_n, seq_len), pad, dtype=torch.int64, device=dev)
        sequence[:, :p] = prompt
        stops = gen.stop is not None
        done = torch.zeros(records_n, dtype=torch.bool, device=dev)  # made the stop token
        made_rows: list[Tensor] = []
        token_rows: list[Tensor] = []
        logp_rows: list[Tensor] = []
        caches = self.cached.new_caches(records_n, seq_len, dev) if self.cached else {}
        for trip in range(n):
            if stops and trip and bool(done.all()):
                break  # every record has stopped: nothing is left to make, the rest is pad
            if stopping():
                return None
            trip_seed = derive_seed(seed, "generate", gen.name, *draw, trip)
            _, token, token_logp = self._trip(sequence, p - 1 + trip, trip == 0, caches, trip_seed)
            if stops:
                made_rows.append(~done)
                token = torch.where(done, pad, token)
                token_logp = torch.where(done, 0.0, token_logp)
                done = done | (token == gen.stop)
            token_rows.append(token)
            logp_rows.append(token_logp)
            sequence[:, p + trip] = token
        trips = len(token_rows)
        tokens = torch.full((records_n, n), pad, dtype=torch.int64, device=dev)
        tokens[:, :trips] = torch.stack(token_rows, dim=1)
        logp = torch.zeros((records_n, n), dtype=torch.float32, device=dev)
        logp[:, :trips] = torch.stack(logp_rows, dim=1)
        made = torch.zeros((records_n, n), dtype=torch.float32, device=dev)
        made[:, :trips] = torch.stack(made_rows, dim=1).float() if stops else 1.0
        following = torch.full_like(sequence, pad)
        following[:, :-1] = sequence[:, 1:]
        following_mask = torch.zeros((records_n, seq_len), dtype=torch.float32, device=dev)
        following_mask[:, p - 1 : p - 1 + n] = made
        out = {
            **repeated,
            "prompt": prompt,
            "completion": tokens,
            "completion-mask": made,
            "sampled-logp": logp,
            "sequence": sequence,
            "next": following,
            "next-mask": following_mask,
        }
        arrays = {k: v.cpu().numpy() if isinstance(v, Tensor) else v for k, v in out.items()}
        arrays["reward"] = self._reward(arrays)
        return arrays

    def _trip(
        self, sequence: Tensor, last: int, first: bool, caches: dict[str, Tensor], seed: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The logits ``[records, vocab]`` at position ``last`` of ``sequence``, and the
        token and log-probability drawn from them with ``seed``'s noise (:func:`choose`):
        through the cache, whose functions draw too (the first trip runs every position
        up to ``last``, a later one ``last`` alone), or from the whole forward. The
        caches are read up to ``last`` (a view: the positions run are written through
        it), or whole with the later positions masked where the strategy wants fixed
        shapes."""
        cached = self.cached
        noise = self._noise((sequence.shape[0], self.gen.vocab), seed)
        if cached is None:
            (logits,) = self.run_graph(self.logits, {"sequence": sequence})
            row = logits[:, last, :].float()
            return (row, *choose(row, noise, self.gen))
        start = 0 if first else last
        positions = torch.arange(start, last + 1, device=self.device)
        if not cached.fixed_shapes:
            caches = {name: cache[:, :, : last + 1] for name, cache in caches.items()}
        inputs = {TOKENS: sequence[:, start : last + 1], POSITIONS: positions, **caches}
        if noise is not None:
            inputs[NOISE] = noise
        row, token, token_logp = self.run_graph(cached.prefill if first else cached.step, inputs)
        return row, token, token_logp

    def _noise(self, shape: tuple[int, ...], seed: int) -> Tensor | None:
        """The uniform noise of one trip's draw (none when it takes the likeliest token)."""
        if self.gen.temperature == 0:
            return None
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return torch.rand(shape, generator=generator, device=self.device)

    def _reward(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        gen = self.gen
        if self.reward is None:
            reward = np.asarray(gen.verify(arrays), dtype=np.float32)
            want = (len(arrays["sequence"]), *gen.fields["reward"].shape[1:])
            if reward.shape != want:
                raise ValueError(
                    f"the data source's verifier gave rewards of shape {list(reward.shape)}, "
                    f"not {list(want)}"
                )
            return reward
        inputs = {
            k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in arrays.items()
        }
        (reward,) = self.run_graph(self.reward, inputs)
        return reward.detach().float().cpu().numpy()

    def warm_up(self, parts: int = 1) -> None:
        """Run what the trips run (the logits graph, or its two decoding functions) and
        the reward graph once on zeros (a compiling strategy compiles them now), for
        one of ``parts`` equal parts of the records."""
        gen = self.gen
        zeros = {
            k: torch.zeros(
                (t.shape[0] // parts, *t.shape[1:]), dtype=TORCH_DTYPES[t.dtype], device=self.device
            )
            for k, t in gen.fields.items()
        }
        sequence, last = zeros["sequence"], gen.prompt_length - 1
        caches = self.cached.new_caches(*sequence.shape, self.device) if self.cached else {}
        for trip in range(min(gen.new_tokens, 2)):  # the cache's two functions, or the graph
            self._trip(sequence, last + trip, trip == 0, caches, seed=trip)
        if self.reward is not None:
            self.run_graph(self.reward, zeros)


def choose(row: Tensor, uniform: Tensor | None, gen: Generator) -> tuple[Tensor, Tensor]:
    """One token per record from ``row``'s logits (``[records, vocab]``) and its
    log-probability at the generator's temperature (1 when it takes the likeliest
    token), before top-k and top-p narrow the choice: the largest filtered logit plus
    the Gumbel noise made from ``uniform``. Torch ops alone, so that a compiled
    decoding function draws inside its graph (:mod:`sexpgpu_torch.decoding`)."""
    row = row.float()
    if gen.temperature == 0 or uniform is None:
        token = row.argmax(dim=-1)
        return token, torch.log_softmax(row, dim=-1).gather(1, token[:, None])[:, 0]
    scaled = row / gen.temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    kept = scaled
    if gen.top_k:
        kth = torch.topk(scaled, gen.top_k, dim=-1).values[:, -1:]
        kept = kept.masked_fill(scaled < kth, float("-inf"))
    if gen.top_p < 1.0:
        kept = _nucleus(kept, gen.top_p)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
    token = (kept + gumbel).argmax(dim=-1)
    return token, logp_all.gather(1, token[:, None])[:, 0]


def _nucleus(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` with every token outside the smallest set whose probability reaches
    ``top_p`` (likeliest first, ties in token order) set to minus infinity."""
    ordered, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # the mass of the likelier tokens
    drop = before >= top_p
    drop[:, 0] = False  # the likeliest token always stays
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
