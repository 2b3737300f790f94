"""Steps per second of examples/tiny-lm.sx through the torch lowering, against the same
model, data and optimizer written by hand in plain PyTorch, in the same process run.

    .venv/bin/python benchmarks/bench_step.py [--steps 20] [--rounds 7] [--threads 1]

Prints the one-time cost of compiling and lowering the file, each side's steps per
second (median over interleaved rounds, so both see the same machine load), and the
ratio ours / hand-written (the goal is >= 0.97 on the CPU). Both sides read the loss
on the host every step, as a run's progress line does.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-lm.sx"


def _hand_written(params0: dict, program, attention: str, compile_model: bool = False):
    """tiny-lm as one would write it in PyTorch: modules, torch.optim.AdamW, clipping;
    with ``compile_model`` the module goes through ``torch.compile`` (bench_compiled.py).
    The step function returned has ``.evaluate(batch)``: the loss with no grad, and
    ``.model``: the module (through ``torch.compile`` with ``compile_model``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from sexpgpu_torch import kernels

    attend = kernels.attention_math if attention == "math" else kernels.attention_sdpa

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1 = nn.LayerNorm(dim)
            self.q = nn.Parameter(torch.empty(dim, dim))
            self.q_b = nn.Parameter(torch.empty(dim))
            self.k = nn.Parameter(torch.empty(dim, dim))
            self.k_b = nn.Parameter(torch.empty(dim))
            self.v = nn.Parameter(torch.empty(dim, dim))
            self.v_b = nn.Parameter(torch.empty(dim))
            self.out = nn.Parameter(torch.empty(dim, dim))
            self.out_b = nn.Parameter(torch.empty(dim))
            self.norm2 = nn.LayerNorm(dim)
            self.up = nn.Parameter(torch.empty(dim, 4 * dim))
            self.up_b = nn.Parameter(torch.empty(4 * dim))
            self.down = nn.Parameter(torch.empty(4 * dim, dim))
            self.down_b = nn.Parameter(torch.empty(dim))

        def forward(self, x):
            h = self.norm1(x)
            a = attend(
                h @ self.q + self.q_b,
                h @ self.k + self.k_b,
                h @ self.v + self.v_b,
                heads=self.heads,
                causal=True,
            )
            x = x + (a @ self.out + self.out_b)
            h = self.norm2(x)
            return x + (F.gelu(h @ self.up + self.up_b) @ self.down + self.down_b)

    class GPT(nn.Module):
        def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.empty(seq, dim))
            self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Parameter(torch.empty(dim, vocab))
            self.head_b = nn.Parameter(torch.empty(vocab))

        def forward(self, ids):
            x = self.embed(ids) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.norm(x) @ self.head + self.head_b

    vocab, dim = params0["model.embed.table"].shape
    seq = params0["model.pos"].shape[0]
    layers = sum(1 for k in params0 if k.endswith(".norm1.weight"))
    heads = next(
        n.attrs["heads"]
        for n in program.stages[0].loss.nodes[5].attrs["body"].nodes
        if n.op == "attention"
    )
    model = GPT(vocab, seq, dim, heads, layers)
    ours_to_theirs = {
        "model.embed.table": model.embed.weight,
        "model.pos": model.pos,
        "model.norm.weight": model.norm.weight,
        "model.norm.bias": model.norm.bias,
        "model.head.weight": model.head,
        "model.head.bias": model.head_b,
    }
    for i, b in enumerate(model.blocks):
        p = f"model.blocks.{i}."
        ours_to_theirs.update(
            {
                p + "norm1.weight": b.norm1.weight,
                p + "norm1.bias": b.norm1.bias,
                p + "attn.q.weight": b.q,
                p + "attn.q.bias": b.q_b,
                p + "attn.k.weight": b.k,
                p + "attn.k.bias": b.k_b,
                p + "attn.v.weight": b.v,
                p + "attn.v.bias": b.v_b,
                p + "attn.out.weight": b.out,
                p + "attn.out.bias": b.out_b,
                p + "norm2.weight": b.norm2.weight,
                p + "norm2.bias": b.norm2.bias,
                p + "ff.up.weight": b.up,
                p + "ff.up.bias": b.up_b,
                p + "ff.down.weight": b.down,
                p + "ff.down.bias": b.down_b,
            }
        )
    assert set(ours_to_theirs) == set(params0), "the hand-written model drifted from tiny-lm.sx"
    with torch.no_grad():
        for path, tensor in ours_to_theirs.items():
            tensor.copy_(torch.from_numpy(params0[path]))
    decl = program.stages[0].optimizer
    no_decay = {p.path for p in program.params if set(p.tags) & {"no-decay"}}
    groups = [
        {"params": [t for k, t in ours_to_theirs.items() if k not in no_decay]},
        {"params": [t for k, t in ours_to_theirs.items() if k in no_decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=decl.options["lr"],
        weight_decay=decl.options["weight_decay"],
        foreach=True,  # the faster of torch's two CPU implementations
    )

    if compile_model:
        model = torch.compile(model)

    def step(batch, lr: float) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(torch.from_numpy(batch["inputs"]))
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            torch.from_numpy(batch["targets"]).reshape(-1),
            ignore_index=-1,  # the sort data masks the prompt's positions with -1
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), decl.clip, foreach=True)
        opt.step()
        return loss.item()

    def evaluate(batch) -> float:
        # as nanoGPT's estimate_loss: the same module with no grad, its own graph
        with torch.no_grad():
            logits = model(torch.from_numpy(batch["inputs"]))
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                torch.from_numpy(batch["targets"]).reshape(-1),
                ignore_index=-1,
            )
        return loss.item()

    step.evaluate = evaluate  # type: ignore[attr-defined]
    step.model = model  # type: ignore[attr-defined]
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per side")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--attention", choices=("math", "sdpa"), default="math")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    from sexpgpu.catalog import Catalog
    from sexpgpu.choices import Choices
    from sexpgpu.lang.schedule import lr_at
    from sexpgpu.session import Selection, lower, open_loader

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    catalog = Catalog.load()
    program = Selection(str(EXAMPLE)).compile(catalog)
    t2 = time.perf_counter()
    pinned = Choices(recorded={"attention:model.blocks.attn": args.attention})
    trainer = lower(program, catalog, device="cpu", choices=pinned).trainer
    t3 = time.perf_counter()
    trainer.init_params()
    t4 = time.perf_counter()

    stage = program.stages[0]
    _, loader = open_loader(catalog, stage.data, program.run.seed)
    total = 5 + args.steps * args.rounds
    batches = [loader.next_batch() for _ in range(total)]
    lrs = [lr_at(stage.optimizer, s, total) for s in range(1, total + 1)]
    hand = _hand_written(trainer.export()[0], program, args.attention)

    def ours(i: int) -> float:
        proposal = trainer.propose(batches[i], stage=0, step=i + 1, lr=lrs[i])
        trainer.commit(proposal)
        return proposal.loss

    # Warm up both, and check they compute the same thing.
    for i in range(5):
        a, b = ours(i), hand(batches[i], lrs[i])
        if not math.isclose(a, b, rel_tol=1e-3):
            sys.exit(f"the two sides disagree at step {i + 1}: loss {a} against {b}")

    rates: dict[str, list[float]] = {"sexpgpu": [], "pytorch": []}
    i = 5
    for _ in range(args.rounds):
        for name, fn in (("sexpgpu", ours), ("pytorch", lambda j: hand(batches[j], lrs[j]))):
            start = time.perf_counter()
            for j in range(i, i + args.steps):
                fn(j)
            rates[name].append(args.steps / (time.perf_counter() - start))
        i += args.steps

    ours_rate = statistics.median(rates["sexpgpu"])
    hand_rate = statistics.median(rates["pytorch"])
    print(f"examples/tiny-lm.sx on cpu, {args.threads} thread(s), attention {args.attention}")
    print(f"  import torch + sexpgpu     {t_import * 1000:8.1f} ms")
    print(f"  compile .sx                {(t2 - t1) * 1000:8.1f} ms")
    print(f"  lower (choose + compile)   {(t3 - t2) * 1000:8.1f} ms")
    print(f"  init_params                {(t4 - t3) * 1000:8.1f} ms")
    print(f"  sexpgpu  steps/s           {ours_rate:8.2f}")
    print(f"  pytorch  steps/s           {hand_rate:8.2f}")
    print(f"  ratio sexpgpu / pytorch    {ours_rate / hand_rate:8.3f}   (goal >= 0.97)")


if __name__ == "__main__":
    main()
