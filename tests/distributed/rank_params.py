"""Run a `.sx` file as one rank under torchrun, as ``sexpgpu run`` does, then leave
this rank's parameters and optimizer states in ``<out>/rank-<n>.safetensors``:
what the data-parallel tests compare across ranks, byte for byte.

    torchrun --nproc-per-node 3 rank_params.py FILE OUT STEPS
"""

import os
import sys

from safetensors.numpy import save_file

from sexpgpu.catalog import Catalog
from sexpgpu.session import Selection, Target
from sexpgpu.signals import StopWatch
from sexpgpu.train import Run, RunOptions


def main() -> int:
    file, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    active = Run(Catalog.load())
    device = os.environ.get("SEXPGPU_DP_TEST_DEVICE", "cpu")
    options = RunOptions(
        selection=Selection(file, steps=steps),
        target=Target(device=device),
        metrics_dir=out,
        metrics_sinks=("jsonl",),
    )
    active.set_up(options, StopWatch())
    outcome = active.train()
    params, states = active.trainer.export()
    tensors = {**params, **{f"states/{name}": array for name, array in states.items()}}
    save_file(tensors, f"{out}/rank-{active.group.rank}.safetensors")
    active.group.close()
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
