"""Generated tokens per second of sexpgpu's generator (``:generate (sample ...)``)
against plain PyTorch sampling from the same model, with the same parameters, in the
same process.

    .venv/bin/python benchmarks/bench_generate.py [--rounds 5] [--calls 2] [--threads 1]
        [--dim 64 --heads 4 --layers 2 --seq 64 --batch 8 --samples 4 --new-tokens 32]
        [--compile] [--json PATH]

The model is examples/rl-sort.sx's tiny-lm GPT (vocab 16) at the sizes given, in a
program written to a temporary folder: its eval pass samples ``--new-tokens`` tokens
after each prompt of ``(sort :vocab 16 :length L)`` (the prompt is L + 1 tokens; L is
the longest that leaves room for the new tokens, or ``--length``), ``--samples``
records per prompt, at temperature 1 and with no ``:stop``, so every record makes
every token. Tokens per second = records * new tokens / seconds.

The sides, each timed on ``--calls`` whole generate calls per round, rounds interleaved
(in a rotating order) so all see the same machine load, after a warm-up call each:

- ``sexpgpu``: ``trainer.generate(...)`` of the eager lowering (``--lowering torch``),
  through its key/value cache (sexpgpu_torch.decoding, docs/generate.md): the prompt
  in one prefill, then one position per trip attending over the whole cache with a
  mask;
- ``hand KV``: the model as benchmarks/bench_step.py writes it in PyTorch (the same
  module, the parameters copied in), sampled the way one writes it by hand: the
  prompt through the model once filling a key/value cache, then one token per trip
  attending over the cached keys and values;
- ``hand full``: the same module, a whole forward per trip (what a generator whose
  root allows no cache runs), for scale.

All three draw alike: a fresh ``torch.Generator`` per trip seeded as ours seeds it,
Gumbel noise, the argmax, and the token's log-probability (ours returns it), so with
the same logits they make the same tokens; the run checks that once (and that ours
and ``hand full`` agree on the first trip's logits within 1e-4), then times.

With ``--compile`` the same three again, compiled: ours through ``--lowering
compiled``, the hand-written ones through ``torch.compile`` (mode default) on the
model call (the KV loop: on its prefill and its one-token step, over a cache of the
whole sequence with a mask, as compiled decoders write it). The first call of each
compiles; its seconds are reported apart. Compiles run on an empty
``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` made for this run (torch's cache folder
outlives a process), ours first, so the hand-written ones compile in a process that
has compiled once already (bench_compile_time.py compares compiles cold).

Prints each side's median tokens/s with its spread (min-max over rounds), the ratios
with the goals: eager sexpgpu >= 0.9x the hand-written KV-cache loop, compiled sexpgpu
>= the hand-written KV loop under torch.compile. Figures that count need an idle
machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import _hand_written  # noqa: E402

VOCAB = 16
TEMPERATURE = 1.0
GOAL_EAGER = 0.9  # sexpgpu eager / hand-written KV loop, eager
GOAL_COMPILED = 1.0  # sexpgpu compiled / hand-written KV loop under torch.compile

PROGRAM = """\
; written by benchmarks/bench_generate.py: examples/rl-sort.sx's model, one sampling pass
(defmodel gpt (vocab seq dim heads layers)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (layer blocks (repeat layers (transformer-block dim heads)))
  (layer norm (layer-norm dim))
  (layer head (linear dim vocab))
  (forward (ids) (-> (+ (embed ids) pos) blocks norm head)))

(defdata prompts (sort :vocab {vocab} :length {length}) :seq {seq} :batch {batch})

(defrun bench-generate
  :model (gpt {vocab} {seq} {dim} {heads} {layers})
  :data prompts
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adamw :lr 0.003 :weight-decay 0.01 :clip 1.0)
  :steps 1
  :seed 1
  :evals ((eval sampled :every 1 :data prompts :batches 1
           :generate (sample model :new-tokens {new_tokens} :samples {samples}
                      :temperature {temperature})
           :metrics ((mean-reward (mean reward))))))
"""


class HandSampler:
    """Sampling from bench_step's hand-written module, as one writes it in PyTorch:
    ``full`` runs the module over the whole sequence each trip; ``kv`` fills a
    key/value cache from the prompt and then feeds one token per trip. ``seeds[t]``
    seeds trip ``t``'s Gumbel noise, as sexpgpu's sampler seeds it."""

    def __init__(self, model: Any, seq: int, new_tokens: int, seeds: list[int]) -> None:
        import torch

        self.torch = torch
        self.model, self.seq, self.new_tokens, self.seeds = model, seq, new_tokens, seeds
        self.heads = model.blocks[0].heads
        self.dim = model.pos.shape[1]
        self.forward: Callable[..., Any] = model
        self.prefill: Callable[..., Any] = self._prefill
        self.decode: Callable[..., Any] = self._decode
        self.whole_cache = False  # attend over the whole cache with a mask (compiled)

    def compile(self) -> None:
        """torch.compile (mode default) on the model call: the whole forward, and the
        KV loop's prefill and one-token step, which then attends over a cache of the
        whole sequence with a mask so that every trip has the same shapes."""
        torch = self.torch
        self.forward = torch.compile(self.model)
        self.prefill = torch.compile(self._prefill)
        self.decode = torch.compile(self._decode)
        self.whole_cache = True

    # -- the one draw both loops make, as sexpgpu_torch.sampling draws it

    def _draw(self, row: Any, trip: int) -> tuple[Any, Any]:
        torch = self.torch
        scaled = row.float() / TEMPERATURE
        logp_all = torch.log_softmax(scaled, dim=-1)
        generator = torch.Generator().manual_seed(self.seeds[trip])
        uniform = torch.rand(row.shape, generator=generator)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
        token = (scaled + gumbel).argmax(dim=-1)
        return token, logp_all.gather(1, token[:, None])[:, 0]

    # -- (b) a whole forward per trip

    def full(self, prompt: Any) -> tuple[Any, Any]:
        torch = self.torch
        records, p = prompt.shape
        sequence = torch.zeros((records, self.seq), dtype=torch.int64)
        sequence[:, :p] = prompt
        tokens = torch.empty((records, self.new_tokens), dtype=torch.int64)
        logp = torch.empty((records, self.new_tokens))
        with torch.no_grad():
            for trip in range(self.new_tokens):
                logits = self.forward(sequence)
                token, token_logp = self._draw(logits[:, p - 1 + trip, :], trip)
                tokens[:, trip], logp[:, trip] = token, token_logp
                sequence[:, p + trip] = token
        return tokens, logp

    # -- (a) a key/value cache

    def kv(self, prompt: Any) -> tuple[Any, Any]:
        torch = self.torch
        records, p = prompt.shape
        head_dim = self.dim // self.heads
        caches = [
            (
                torch.zeros((records, self.heads, self.seq, head_dim)),
                torch.zeros((records, self.heads, self.seq, head_dim)),
            )
            for _ in self.model.blocks
        ]
        tokens = torch.empty((records, self.new_tokens), dtype=torch.int64)
        logp = torch.empty((records, self.new_tokens))
        with torch.no_grad():
            token, token_logp = self._draw(self.prefill(prompt, caches), 0)
            tokens[:, 0], logp[:, 0] = token, token_logp
            for trip in range(1, self.new_tokens):
                at = p + trip - 1  # the position of the token made last trip
                keys = None if self.whole_cache else at + 1
                logits = self.decode(token[:, None], torch.tensor([at]), caches, keys)
                token, token_logp = self._draw(logits, trip)
                tokens[:, trip], logp[:, trip] = token, token_logp
        return tokens, logp

    def _split(self, x: Any) -> Any:
        b, t, d = x.shape
        return x.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

    def _attend(self, q: Any, k: Any, v: Any, masked: Any) -> Any:
        # written as the math attention kernel: softmax(Q K^T / sqrt(d_head)) V
        torch = self.torch
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        b, h, t, hd = out.shape
        return out.transpose(1, 2).reshape(b, t, h * hd)

    def _block(self, b: Any, x: Any, cache: tuple[Any, Any], write: Callable, masked: Any):
        import torch.nn.functional as F

        h = b.norm1(x)
        q = self._split(h @ b.q + b.q_b)
        k = self._split(h @ b.k + b.k_b)
        v = self._split(h @ b.v + b.v_b)
        keys, values = write(cache, k, v)
        x = x + (self._attend(q, keys, values, masked) @ b.out + b.out_b)
        h = b.norm2(x)
        return x + (F.gelu(h @ b.up + b.up_b) @ b.down + b.down_b)

    def _logits(self, x: Any) -> Any:
        m = self.model
        return m.norm(x[:, -1]) @ m.head + m.head_b

    def _prefill(self, ids: Any, caches: list[tuple[Any, Any]]) -> Any:
        """The prompt through the model, its keys and values into the caches; the
        logits at its last position."""
        torch = self.torch
        m, t = self.model, ids.shape[1]
        x = m.embed(ids) + m.pos[:t]
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)

        def write(cache, k, v):
            cache[0][:, :, :t] = k
            cache[1][:, :, :t] = v
            return k, v

        for block, cache in zip(m.blocks, caches, strict=True):
            x = self._block(block, x, cache, write, causal)
        return self._logits(x)

    def _decode(self, token: Any, at: Any, caches: list[tuple[Any, Any]], keys: int | None):
        """One token per record at position ``at`` (a one-element tensor): its keys and
        values into the caches, attending over the first ``keys`` cached positions
        (eager), or over the whole cache with the positions after ``at`` masked."""
        torch = self.torch
        m = self.model
        x = m.embed(token) + m.pos[at]
        masked = None if keys is not None else torch.arange(self.seq) > at

        def write(cache, k, v):
            cache[0].index_copy_(2, at, k)
            cache[1].index_copy_(2, at, v)
            if keys is None:
                return cache
            return cache[0][:, :, :keys], cache[1][:, :, :keys]

        for block, cache in zip(m.blocks, caches, strict=True):
            x = self._block(block, x, cache, write, masked)
        return self._logits(x)


def _ratio_line(name: str, ours: list[float], theirs: list[float], goal: float | None) -> str:
    ratio = statistics.median(ours) / statistics.median(theirs)
    per_round = [a / b for a, b in zip(ours, theirs, strict=True)]
    line = f"  {name:38} {ratio:6.3f}   per round {min(per_round):.3f}-{max(per_round):.3f}"
    if goal is not None:
        line += f"   goal >= {goal:g}: {'met' if ratio >= goal else 'MISSED'}"
    return line


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per side")
    parser.add_argument("--calls", type=int, default=2, help="generate calls per timed round")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--attention", choices=("math", "sdpa"), default="math")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="prompts per call")
    parser.add_argument("--samples", type=int, default=4, help="records per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--length", type=int, help="the sort's length (prompt = length + 1)")
    parser.add_argument("--compile", action="store_true", help="also the compiled sides")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    length = args.length or min((args.seq - 1) // 2, args.seq - args.new_tokens - 1)
    if length < 1:
        sys.exit(f"--new-tokens {args.new_tokens} leaves no room for a prompt in --seq {args.seq}")

    scratch = Path(tempfile.mkdtemp(prefix="sexpgpu-generate-bench-"))
    if args.compile:
        # torch's compile caches outlive a process: an empty folder for this run, and
        # an empty TMPDIR for inductor's headers, so the first compile here is cold
        (scratch / "tmp").mkdir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
        os.environ["TMPDIR"] = tempfile.tempdir = str(scratch / "tmp")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    try:
        _measure(args, length, scratch)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


def _measure(args: argparse.Namespace, length: int, scratch: Path) -> None:
    load_before = os.getloadavg()
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from sexpgpu.catalog import Catalog
    from sexpgpu.session import Selection, Target, lower, open_loader
    from sexpgpu_torch.rng import derive_seed

    source = scratch / "bench-generate.sx"
    source.write_text(
        PROGRAM.format(
            vocab=VOCAB,
            length=length,
            seq=args.seq,
            batch=args.batch,
            dim=args.dim,
            heads=args.heads,
            layers=args.layers,
            new_tokens=args.new_tokens,
            samples=args.samples,
            temperature=TEMPERATURE,
        )
    )
    catalog = Catalog.load()
    program = Selection(str(source)).compile(catalog)
    passed = program.evals[0]
    gen = passed.generator
    records, prompt_len, new = gen.fields["sequence"].shape[0], gen.prompt_length, gen.new_tokens

    def lowered(lowering: str) -> Any:
        choices = Target(lowering=lowering, choose={"attention": args.attention})
        return lower(program, catalog, device="cpu", choices=choices.choices(program, None)).trainer

    eager = lowered("torch")
    eager.init_params()
    params = eager.export()[0]
    hand = HandSampler(
        _hand_written(params, program, args.attention).model,
        args.seq,
        new,
        [derive_seed(program.run.seed, "generate", gen.name, 1, t) for t in range(new)],
    )
    _, loader = open_loader(catalog, passed.data, program.run.seed)
    batch = loader.next_batch()

    def never() -> bool:
        return False

    def ours_of(trainer: Any) -> Callable[[], Any]:
        def call() -> Any:
            out = trainer.generate(gen, batch, seed=program.run.seed, draw=(1,), stopping=never)
            return out["completion"], out["sampled-logp"]

        return call

    def hand_of(loop: Callable[[Any], tuple[Any, Any]]) -> Callable[[], Any]:
        def call() -> Any:
            prompt = np.repeat(batch["inputs"][:, :prompt_len], gen.samples, axis=0)
            tokens, logp = loop(torch.from_numpy(np.ascontiguousarray(prompt)))
            return tokens.numpy(), logp.numpy()

        return call

    # The same model: ours and the hand-written module on the first trip's sequence.
    sampler = eager.samplers[gen.name]
    sequence = torch.zeros((records, args.seq), dtype=torch.int64)
    prompt = torch.from_numpy(
        np.ascontiguousarray(np.repeat(batch["inputs"][:, :prompt_len], gen.samples, axis=0))
    )
    sequence[:, :prompt_len] = prompt
    (ours_logits,) = sampler.run_graph(sampler.logits, {"sequence": sequence})
    head_dim = args.dim // args.heads
    with torch.no_grad():
        hand_logits = hand.model(sequence)
        shape = (records, args.heads, args.seq, head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(args.layers)]
        kv_logits = hand.prefill(prompt, caches)
    row = prompt_len - 1
    diff_full = (ours_logits[:, row] - hand_logits[:, row]).abs().max().item()
    diff_kv = (ours_logits[:, row] - kv_logits).abs().max().item()
    if diff_full >= 1e-4 or diff_kv >= 1e-4:
        sys.exit(
            f"the hand-written model disagrees with ours on the first trip's logits: "
            f"max |diff| {diff_full:.2e} (full forward), {diff_kv:.2e} (KV prefill)"
        )

    sides: dict[str, Callable[[], Any]] = {
        "sexpgpu eager": ours_of(eager),
        "hand KV eager": hand_of(hand.kv),
        "hand full eager": hand_of(hand.full),
    }
    first: dict[str, float] = {}
    made: dict[str, Any] = {}
    for name, fn in sides.items():  # warm-up, and the tokens each makes
        started = time.perf_counter()
        made[name] = fn()
        first[name] = time.perf_counter() - started

    if args.compile:
        compiled = lowered("compiled")
        compiled.set_params(params)
        compiled_hand = HandSampler(hand.model, args.seq, new, hand.seeds)
        compiled_hand.compile()
        compiled_sides = {
            "sexpgpu compiled": ours_of(compiled),
            "hand KV compiled": hand_of(compiled_hand.kv),
            "hand full compiled": hand_of(compiled_hand.full),
        }
        for name, fn in compiled_sides.items():  # the first call compiles, ours first
            started = time.perf_counter()
            made[name] = fn()
            first[name] = time.perf_counter() - started
        sides.update(compiled_sides)

    reference = made["sexpgpu eager"][0]
    same = {
        name: int((tokens == reference).all(axis=1).sum())
        for name, (tokens, _) in made.items()
        if name != "sexpgpu eager"
    }
    logp_diff = max(float(np.abs(lp - made["sexpgpu eager"][1]).max()) for _, lp in made.values())

    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = sides[name]
            started = time.perf_counter()
            for _ in range(args.calls):
                fn()
            rates[name].append(args.calls * records * new / (time.perf_counter() - started))
    load_after = os.getloadavg()

    print(
        f"tiny-lm GPT (vocab {VOCAB}, dim {args.dim}, heads {args.heads}, layers {args.layers}, "
        f"seq {args.seq}) on cpu, {args.threads} thread(s), attention {args.attention}"
    )
    print(
        f"  {args.batch} prompts x {args.samples} samples = {records} records, prompt "
        f"{prompt_len} + {new} new tokens, temperature {TEMPERATURE:g}, no stop; "
        f"{args.rounds} rounds of {args.calls} calls"
    )
    print(
        f"  load average {load_before[0]:.2f} before, {load_after[0]:.2f} after: "
        "figures that count need an idle machine"
    )
    print(
        f"  same model: first trip's logits, max |ours - hand full| {diff_full:.1e}, "
        f"|ours - hand KV prefill| {diff_kv:.1e} (< 1e-4)"
    )
    print(
        "  same tokens as sexpgpu eager: "
        + ", ".join(f"{name} {n}/{records}" for name, n in same.items())
        + f"; max |logp diff| {logp_diff:.1e}"
    )
    if args.compile:
        print("  first call (compiles; ours first, so the others compile in a warm process):")
        for name in ("sexpgpu compiled", "hand KV compiled", "hand full compiled"):
            print(f"    {name:20} {first[name]:7.1f} s")
    print("  tokens/s               median      spread (min-max over rounds)")
    for name, values in rates.items():
        print(
            f"    {name:20} {statistics.median(values):9.0f}   {min(values):.0f}-{max(values):.0f}"
        )
    print("  ratios (median / median)")
    lines = [
        _ratio_line(
            "sexpgpu eager / hand KV eager",
            rates["sexpgpu eager"],
            rates["hand KV eager"],
            GOAL_EAGER,
        ),
        _ratio_line(
            "sexpgpu eager / hand full eager",
            rates["sexpgpu eager"],
            rates["hand full eager"],
            None,
        ),
    ]
    if args.compile:
        lines += [
            _ratio_line(
                "sexpgpu compiled / hand KV compiled",
                rates["sexpgpu compiled"],
                rates["hand KV compiled"],
                GOAL_COMPILED,
            ),
            _ratio_line(
                "sexpgpu compiled / hand full compiled",
                rates["sexpgpu compiled"],
                rates["hand full compiled"],
                None,
            ),
        ]
    print("\n".join(lines))
    if args.json:
        figures = {
            "settings": {**{k: v for k, v in vars(args).items() if k != "json"}, "length": length},
            "records": records,
            "prompt": prompt_len,
            "load_average": [load_before[0], load_after[0]],
            "logits_max_abs_diff": {"hand full": diff_full, "hand KV prefill": diff_kv},
            "same_tokens": same,
            "first_call_s": first,
            "tokens_per_s": {
                name: {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                    "rounds": values,
                }
                for name, values in rates.items()
            },
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"  wrote {args.json}")


if __name__ == "__main__":
    main()
