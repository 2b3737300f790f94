"""A helper the recompute tests run in a subprocess (torch.compile's worker threads
would outlive an in-process test): ``python recompute_probe.py FILE STEPS``.

It trains FILE's first stage for STEPS steps three ways, the repeat's stack kernel
pinned: eager ``looped``, eager ``unrolled`` and compiled ``recompute``. For each it
prints, as one JSON object, the losses, and the element counts of the tensors
autograd keeps for the backward pass of the last step (through torch's
saved-tensor hooks, which the compiled graphs' autograd functions go through as
well): a repeat that recomputes keeps none of its body's inner activations. Last,
the graph breaks torch counted, and how many graphs it compiled.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from sexpgpu.catalog import Catalog
from sexpgpu.lang import compile_file
from sexpgpu.session import Target, lower, open_loader

CATALOG = Catalog.load()

WAYS = (("torch", "looped"), ("torch", "unrolled"), ("compiled", "recompute"))


def train(program: Any, lowering: str, kernel: str, steps: int) -> dict[str, Any]:
    """Losses and the last step's saved-tensor sizes, the stack sites pinned to ``kernel``."""
    pinned = {site.name: kernel for site in program.sites if site.kind == "stack"}
    choices = Target(lowering=lowering).choices(program, pinned)
    trainer = lower(program, CATALOG, device="cpu", choices=choices).trainer
    trainer.warm_up()  # as a run does
    trainer.init_params()
    _, loader = open_loader(CATALOG, program.stages[0].data, program.run.seed)
    losses, saved = [], []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    for step in range(1, steps + 1):
        batch = loader.next_batch()
        if step == steps:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                proposal = trainer.propose(batch, stage=0, step=step, lr=0.01)
        else:
            proposal = trainer.propose(batch, stage=0, step=step, lr=0.01)
        losses.append(proposal.loss)
        trainer.commit(proposal)
    return {"choices": dict(trainer.choices), "losses": losses, "saved": saved}


def main() -> None:
    """Print the three ways' results and the graph breaks as JSON."""
    from torch._dynamo.utils import counters

    file, steps = sys.argv[1], int(sys.argv[2])
    program = compile_file(file, catalog=CATALOG)
    result = {f"{low}/{kernel}": train(program, low, kernel, steps) for low, kernel in WAYS}
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["graphs_compiled"] = counters["stats"]["unique_graphs"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
