"""The GPU measurements of benchmarks/gpu_check.sh, as JSON files under ``--results``.

    python benchmarks/gpu_check.py --results DIR [--cpu-smoke] [--rounds 3] [--steps 10]

- ``throughput.json``: examples/gpt2-small.sx (bf16, batch 16 x 1024, vocabulary
  50257) through the compiled lowering (its update through torch's fused kernels,
  the default, and as one compiled graph: ``optimizer.update``) and the eager
  lowering, against the same GPT-2 from
  the same initial parameters written the way nanoGPT writes it (the module returns
  the loss, the whole module under ``torch.compile``, fused AdamW, bf16 autocast,
  SDPA, clipping), the same with the vocabulary padded to 50304, and that module
  run eagerly; interleaved rounds in this one process: tokens/s of each (median,
  min, max), MFU (6N + 12*L*T*d FLOP per token against a bf16 matmul peak measured
  here), each step's peak memory, compile seconds, and the ratios (goals: compiled
  >= 1.0 of nanoGPT-style, eager >= 0.95 of eager hand-written).
- ``checkpoint_stall.json``: the loop's wait for a checkpoint snapshot (the trainer's
  ``export``) against a plain device-to-host copy of the same tensors into pinned
  buffers (goal <= 2x).
- ``guard.json``: the fused finite guard's time per step against the step (goal <= 3%);
  a guarded run's fused update also copies the parameters and states first, which
  this figure leaves out.

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
FULL = {"dim": "768", "heads": "12", "layers": "12", "context": "1024", "batch": "16"}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def nanogpt_style(
    params0: dict, knobs: dict, device: str, *, pad_to: int = 0, compiled: bool = True
):
    """GPT-2 written the way nanoGPT writes it, from our initial parameters: the module
    takes the targets and returns the loss (the cross-entropy inside the compiled
    graph, so inductor fuses it and pads its matmuls), one fused q/k/v projection,
    SDPA, the whole module under ``torch.compile``, fused AdamW (foreach on the CPU)
    with nanoGPT's decay groups, bf16 autocast, clipping at 1.0. ``pad_to`` > 0 pads
    the vocabulary to a multiple of it (nanoGPT's 50304) with zero rows: another model
    (its softmax has more classes), for speed only. ``compiled=False`` is the same
    module run eagerly, what the eager lowering is weighed against. Returns one step
    function."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    dim, heads, layers = int(knobs["dim"]), int(knobs["heads"]), int(knobs["layers"])
    given = {k: torch.from_numpy(v).to(device) for k, v in params0.items()}

    def linear(prefix: str, *names: str) -> nn.Linear:
        weight = torch.cat([given[f"{prefix}{n}.weight"] for n in names], dim=1)  # [in, out]
        bias = torch.cat([given[f"{prefix}{n}.bias"] for n in names])
        layer = nn.Linear(weight.shape[0], weight.shape[1], device=device)
        with torch.no_grad():
            layer.weight.copy_(weight.t())
            layer.bias.copy_(bias)
        return layer

    def norm(prefix: str) -> nn.LayerNorm:
        layer = nn.LayerNorm(dim, device=device)
        with torch.no_grad():
            layer.weight.copy_(given[f"{prefix}.weight"])
            layer.bias.copy_(given[f"{prefix}.bias"])
        return layer

    class Block(nn.Module):
        def __init__(self, prefix: str) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = norm(f"{prefix}norm1"), norm(f"{prefix}norm2")
            self.c_attn = linear(f"{prefix}attn.", "q", "k", "v")
            self.c_proj = linear(f"{prefix}attn.", "out")
            self.c_fc, self.mlp_proj = linear(f"{prefix}ff.", "up"), linear(f"{prefix}ff.", "down")

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            table = given["model.wte.table"]
            if pad_to:
                extra = -table.shape[0] % pad_to
                table = torch.cat([table, table.new_zeros(extra, table.shape[1])])
            self.wte = nn.Parameter(table.clone())
            self.wpe = nn.Parameter(given["model.wpe"].clone())
            self.h = nn.ModuleList(Block(f"model.blocks.{i}.") for i in range(layers))
            self.ln_f = norm("model.ln-f")

        def forward(self, ids, targets):
            x = self.wte[ids] + self.wpe[: ids.shape[1]]
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.t()  # tied, as GPT-2's lm_head
            return F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )

    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = {"fused": True} if device.startswith("cuda") else {"foreach": True}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), **fused,
    )  # fmt: skip
    forward = torch.compile(model) if compiled else model

    def step(batch, lr: float):
        for group in opt.param_groups:
            group["lr"] = lr
        ids = torch.from_numpy(batch["inputs"]).to(device, non_blocking=True)
        targets = torch.from_numpy(batch["targets"]).to(device, non_blocking=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            loss = forward(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # read at the end of a round, as nanoGPT reads it every few steps

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


def _trainer(program, catalog, device: str, lowering: str, update: str | None = None):
    from sexpgpu.session import Target, lower
    from sexpgpu_torch.names import UPDATE

    pinned = {UPDATE: update} if update else {}  # a new run's default otherwise
    choices = Target(device=device, lowering=lowering, requests=pinned).choices(program, None)
    trainer = lower(program, catalog, device=device, choices=choices).trainer
    started = time.perf_counter()
    trainer.warm_up()  # as a run does: every graph compiled before the first step
    seconds = time.perf_counter() - started
    trainer.init_params()
    return trainer, seconds


def _ours(trainer, batches: list, lrs: list):
    """A step of ``trainer`` as the run's loop takes one: propose, commit; the loss is
    not read here (the loop reads it a step late, with the GPU busy)."""
    counter = [0]
    last: dict = {}

    def step(j: int):
        counter[0] += 1
        proposal = trainer.propose(batches[j], stage=0, step=counter[0], lr=lrs[counter[0]])
        trainer.commit(proposal)
        last["proposal"] = proposal
        return proposal.loss_tensor

    return step, last


def matmul_peak(device: str, size: int, repeats: int = 20) -> float:
    """bf16 multiply-accumulate throughput of one square matmul here (FLOP/s): the peak
    MFU is taken against, measured in this process."""
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _peak_memory(fn, device: str) -> int | None:
    """Bytes one more step of ``fn`` holds above what was allocated before it (CUDA)."""
    import torch

    if not device.startswith("cuda"):
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(0)
    _sync(device)
    return torch.cuda.max_memory_allocated() - before


def measure(args: argparse.Namespace) -> dict:
    """Every figure, as the JSON files hold them."""
    import torch

    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.schedule import lr_at
    from sexpgpu.session import Selection, open_loader

    device = "cpu" if args.cpu_smoke else "cuda"
    knobs = dict(SMOKE) if args.cpu_smoke else dict(FULL)
    catalog = Catalog.load()
    program = Selection(str(EXAMPLE), sets=knobs).compile(catalog)
    trainer, compile_seconds = _trainer(program, catalog, device, "compiled")
    eager_trainer, _ = _trainer(program, catalog, device, "torch")
    # the update as one compiled graph, the choice before torch's fused kernels
    graph_trainer, _ = _trainer(program, catalog, device, "compiled", update="compiled")
    stage = program.stages[0]
    _, loader = open_loader(catalog, stage.data, program.run.seed)
    batches = [loader.next_batch() for _ in range(4)]
    lrs = [lr_at(stage.optimizer, s, 1000) for s in range(1, 1001)]
    params0 = {k: v.copy() for k, v in trainer.export()[0].items()}
    ours, last = _ours(trainer, batches, lrs)
    ours_eager, _ = _ours(eager_trainer, batches, lrs)
    ours_graph, _ = _ours(graph_trainer, batches, lrs)
    references = {
        "nanogpt-compiled": nanogpt_style(params0, knobs, device),
        "nanogpt-compiled-vocab-padded": nanogpt_style(params0, knobs, device, pad_to=64),
        "nanogpt-eager": nanogpt_style(params0, knobs, device, compiled=False),
    }
    sides = {
        "sexpgpu-compiled": ours,
        "sexpgpu-eager": ours_eager,
        "sexpgpu-compiled-update-graph": ours_graph,
        **{name: (lambda j, f=f: f(batches[j], lrs[j])) for name, f in references.items()},
    }
    warm_seconds, first_losses = {}, {}
    for name, fn in sides.items():  # compiles each side's graphs: cold against cold
        started = time.perf_counter()
        first_losses[name] = [float(fn(j)) for j in range(2)]
        warm_seconds[name] = time.perf_counter() - started
    memory = {name: _peak_memory(fn, device) for name, fn in sides.items()}
    rates = _rates(sides, batches, lrs, args.rounds, args.steps, device)
    tokens = int(knobs["batch"]) * int(knobs["context"])
    params = sum(v.size for v in params0.values())
    dim, layers, context = (int(knobs[k]) for k in ("dim", "layers", "context"))
    flops_per_token = 6 * params + 12 * layers * context * dim
    peak = matmul_peak(device, 8192 if device == "cuda" else 256)
    median = {name: statistics.median(v) * tokens for name, v in rates.items()}
    throughput = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "model": f"gpt2-small.sx {knobs}",
        "precision": program.run.precision,
        "choices": dict(trainer.choices),
        "eager_choices": dict(eager_trainer.choices),
        "compile_seconds": {"sexpgpu-compiled warm_up": compile_seconds, **warm_seconds},
        "first_losses": first_losses,
        "step_peak_memory_bytes": memory,
        "tokens_per_s": {name: _summary(v, tokens) for name, v in rates.items()},
        "mfu": {name: rate * flops_per_token / peak for name, rate in median.items()},
        "flops_per_token": flops_per_token,
        "bf16_matmul_peak_flops": peak,
        "ratio_compiled_vs_nanogpt": median["sexpgpu-compiled"] / median["nanogpt-compiled"],
        "ratio_compiled_vs_nanogpt_padded": median["sexpgpu-compiled"]
        / median["nanogpt-compiled-vocab-padded"],
        "ratio_eager_vs_nanogpt_eager": median["sexpgpu-eager"] / median["nanogpt-eager"],
        "ratio_update_fused_vs_graph": median["sexpgpu-compiled"]
        / median["sexpgpu-compiled-update-graph"],
        "goal": "ratio_compiled_vs_nanogpt >= 1.0 (1.15 aimed at); "
        "ratio_eager_vs_nanogpt_eager >= 0.95; peak memory <= nanogpt-compiled's",
    }
    stall = _stall(trainer, device)
    guard = _guard(trainer, last["proposal"], rates["sexpgpu-compiled"], device)
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
            k: v.get("ratio", v.get("ratio_compiled_vs_nanogpt", v.get("fraction_of_step")))
            for k, v in figures.items()
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
