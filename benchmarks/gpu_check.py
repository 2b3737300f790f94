"""The GPU measurements of benchmarks/gpu_check.sh, as JSON files under ``--results``.

    python benchmarks/gpu_check.py --results DIR [--cpu-smoke] [--rounds 3] [--steps 10]

- ``throughput.json``: examples/gpt2-small.sx (bf16, batch 16 x 1024) through the
  compiled lowering, against the same GPT-2 hand-written in PyTorch, eager and under
  ``torch.compile`` (bf16 autocast, fused AdamW, clipping), interleaved rounds in
  this one process: tokens/s of each (median, min, max) and the ratios (goal: >= 1.0
  of the compiled one).
- ``checkpoint_stall.json``: the loop's wait for a checkpoint snapshot (the trainer's
  ``export``) against a plain device-to-host copy of the same tensors into pinned
  buffers (goal <= 2x).
- ``guard.json``: the fused finite guard's time per step against the step (goal <= 3%).

``--cpu-smoke`` runs every path here on the CPU at a toy size (dim 64, 2 layers,
context 64, batch 2), to check the script itself on a machine without a GPU; its
figures mean nothing. Bit-exact resume on the GPU is tests/compiled/test_cuda.py,
which the shell script runs first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt2-small.sx"
SMOKE = {"dim": "64", "layers": "2", "heads": "2", "context": "64", "batch": "2"}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hand_written(params0: dict, knobs: dict, device: str, compiled: bool):
    """GPT-2 as one writes it in PyTorch, from our initial parameters: one step function."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    dim, heads, layers = int(knobs["dim"]), int(knobs["heads"]), int(knobs["layers"])
    names = {k: torch.from_numpy(v).to(device) for k, v in params0.items()}

    class Block(nn.Module):
        def __init__(self, prefix: str) -> None:
            super().__init__()
            self.p = nn.ParameterDict(
                {
                    k[len(prefix) :].replace(".", "_"): nn.Parameter(v.clone())
                    for k, v in names.items()
                    if k.startswith(prefix)
                }
            )

        def forward(self, x):
            p = self.p
            h = F.layer_norm(x, (dim,), p["norm1_weight"], p["norm1_bias"])
            q, k, v = (
                (h @ p[f"attn_{n}_weight"] + p[f"attn_{n}_bias"])
                .view(*x.shape[:2], heads, -1)
                .transpose(1, 2)
                for n in "qkv"
            )
            a = (
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
                .transpose(1, 2)
                .reshape(x.shape)
            )
            x = x + a @ p["attn_out_weight"] + p["attn_out_bias"]
            h = F.layer_norm(x, (dim,), p["norm2_weight"], p["norm2_bias"])
            return (
                x
                + F.gelu(h @ p["ff_up_weight"] + p["ff_up_bias"]) @ p["ff_down_weight"]
                + p["ff_down_bias"]
            )

    class GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Parameter(names["model.wte.table"].clone())
            self.wpe = nn.Parameter(names["model.wpe"].clone())
            self.blocks = nn.ModuleList(Block(f"model.blocks.{i}.") for i in range(layers))
            self.ln_w = nn.Parameter(names["model.ln-f.weight"].clone())
            self.ln_b = nn.Parameter(names["model.ln-f.bias"].clone())

        def forward(self, ids):
            x = self.wte[ids] + self.wpe
            for block in self.blocks:
                x = block(x)
            return F.layer_norm(x, (dim,), self.ln_w, self.ln_b) @ self.wte.t()

    model = GPT2()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, **({"fused": True} if cuda else {"foreach": True}),
    )  # fmt: skip
    forward = torch.compile(model) if compiled else model

    def step(batch, lr: float) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        ids = torch.from_numpy(batch["inputs"]).to(device, non_blocking=True)
        targets = torch.from_numpy(batch["targets"]).to(device, non_blocking=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            logits = forward(ids)
        loss = F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        return loss.item()

    return step


def _rates(sides: dict, batches: list, lrs: list, rounds: int, steps: int, device: str) -> dict:
    rates: dict[str, list[float]] = {name: [] for name in sides}
    i = 0
    for _ in range(rounds):
        for name, fn in sides.items():
            _sync(device)
            start = time.perf_counter()
            for j in range(i, i + steps):
                fn(j % len(batches))
            _sync(device)
            rates[name].append(steps / (time.perf_counter() - start))
        i += steps
    return rates


def _summary(values: list[float], scale: float = 1.0) -> dict:
    return {
        "median": statistics.median(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
    }


def measure(args: argparse.Namespace) -> dict:
    """Every figure, as the JSON files hold them."""
    import torch

    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.schedule import lr_at
    from sexpgpu.session import Selection, Target, lower, open_loader

    device = "cpu" if args.cpu_smoke else "cuda"
    knobs = (
        dict(SMOKE)
        if args.cpu_smoke
        else {"dim": "768", "heads": "12", "layers": "12", "context": "1024", "batch": "16"}
    )
    catalog = Catalog.load()
    program = Selection(str(EXAMPLE), sets=knobs).compile(catalog)
    started = time.perf_counter()
    choices = Target(device=device, lowering="compiled").choices(program, None)
    trainer = lower(program, catalog, device=device, choices=choices).trainer
    trainer.warm_up()  # as a run does: every graph compiled before the first step
    compile_seconds = time.perf_counter() - started
    trainer.init_params()
    stage = program.stages[0]
    _, loader = open_loader(catalog, stage.data, program.run.seed)
    batches = [loader.next_batch() for _ in range(4)]
    lrs = [lr_at(stage.optimizer, s, 1000) for s in range(1, 1001)]
    params0 = trainer.export()[0]
    params0 = {k: v.copy() for k, v in params0.items()}
    eager = hand_written(params0, knobs, device, compiled=False)
    compiled = hand_written(params0, knobs, device, compiled=True)
    step_box = [0]
    last: dict = {}

    def ours(j: int) -> float:
        step_box[0] += 1
        proposal = trainer.propose(batches[j], stage=0, step=step_box[0], lr=lrs[step_box[0]])
        trainer.commit(proposal)
        last["proposal"] = proposal
        return proposal.loss

    sides = {
        "sexpgpu": ours,
        "pytorch-eager": lambda j: eager(batches[j], lrs[j]),
        "pytorch-compile": lambda j: compiled(batches[j], lrs[j]),
    }
    started = time.perf_counter()
    warm = {name: [fn(j) for j in range(2)] for name, fn in sides.items()}  # compiles the rest
    warm_seconds = time.perf_counter() - started
    rates = _rates(sides, batches, lrs, args.rounds, args.steps, device)
    tokens = int(knobs["batch"]) * int(knobs["context"])
    throughput = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "model": f"gpt2-small.sx {knobs}",
        "precision": program.run.precision,
        "choices": dict(trainer.choices),
        "compile_seconds": {"sexpgpu": compile_seconds, "others_warm_up": warm_seconds},
        "first_losses": warm,
        "tokens_per_s": {name: _summary(v, tokens) for name, v in rates.items()},
        "ratio_vs_compile": statistics.median(rates["sexpgpu"])
        / statistics.median(rates["pytorch-compile"]),
        "ratio_vs_eager": statistics.median(rates["sexpgpu"])
        / statistics.median(rates["pytorch-eager"]),
        "goal": "ratio_vs_compile >= 1.0",
    }
    stall = _stall(trainer, device)
    guard = _guard(trainer, last["proposal"], rates["sexpgpu"], device)
    return {"throughput": throughput, "checkpoint_stall": stall, "guard": guard}


def _stall(trainer, device: str, repeats: int = 5) -> dict:
    import torch

    trainer.export(reuse=True)  # the first one allocates and pins the buffers
    ours = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        trainer.export(reuse=True)
        ours.append(time.perf_counter() - start)
    tensors = list(trainer.params.values()) + [t for ts in trainer.states.values() for t in ts]
    pinned = [
        torch.empty(t.shape, dtype=torch.float32, pin_memory=device == "cuda") for t in tensors
    ]
    plain = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for host, t in zip(pinned, tensors, strict=True):
            host.copy_(t.detach(), non_blocking=True)
        _sync(device)
        plain.append(time.perf_counter() - start)
    return {
        "tensors": len(tensors),
        "bytes": sum(t.numel() * 4 for t in tensors),
        "export_seconds": _summary(ours),
        "pinned_copy_seconds": _summary(plain),
        "ratio": statistics.median(ours) / statistics.median(plain),
        "goal": "ratio <= 2",
    }


def _guard(trainer, proposal, step_rates: list[float], device: str, repeats: int = 20) -> dict:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        found = trainer.find_non_finite(proposal)
        times.append(time.perf_counter() - start)
    step_seconds = 1.0 / statistics.median(step_rates)
    return {
        "found": found,
        "guard_seconds": _summary(times),
        "step_seconds": step_seconds,
        "fraction_of_step": statistics.median(times) / step_seconds,
        "goal": "fraction_of_step <= 0.03",
    }


def main() -> None:
    """Measure and write the JSON files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.cpu_smoke:
        args.rounds, args.steps = min(args.rounds, 2), min(args.steps, 2)
    args.results.mkdir(parents=True, exist_ok=True)
    figures = measure(args)
    for name, value in figures.items():
        (args.results / f"{name}.json").write_text(json.dumps(value, indent=2, default=str))
    json.dump(
        {
            k: v.get("ratio", v.get("ratio_vs_compile", v.get("fraction_of_step")))
            for k, v in figures.items()
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
