"""Checkpoint write speed against plain PyTorch + safetensors on the same disk.

Writes a ~200 MB model (50 tensors of 1M f32) with ``write_checkpoint`` through the
local storage backend, and the same tensors with ``safetensors.torch.save_file``
into the same folder, alternating, and prints the ratio of the fastest runs (goal:
<= 1.1): on a shared machine the fastest run is the one least disturbed. The local backend makes every file durable (fsync, rename, fsync of the
folder), so the fair baseline fsyncs its file too; the unsynced baseline is
printed as well. Two inputs are measured: plain arrays (what ``export`` returns
today: one copy into the file's buffer) and arrays made by ``layout_tensors``
(already the file's buffer: no copy).

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py [--tensors 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def main() -> None:
    """Run the comparison and print one line per measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--elements", type=int, default=1_000_000, help="per tensor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure")
    args = parser.parse_args()

    import numpy as np
    import torch
    from safetensors.torch import save_file

    from sexpgpu import checkpoint as ckpt
    from sexpgpu.storage import open_location

    rng = np.random.default_rng(0)
    params = {
        f"model.layers.{i}.w": rng.standard_normal(args.elements, dtype=np.float32)
        for i in range(args.tensors)
    }
    laid_out = ckpt.layout_tensors({name: (a.shape, a.dtype) for name, a in params.items()})
    for name, array in params.items():
        laid_out[name][...] = array
    # The baseline writes the same host tensors, torch sharing their memory.
    tensors = {name: torch.from_numpy(array) for name, array in params.items()}
    megabytes = sum(a.nbytes for a in params.values()) / 1e6
    state = ckpt.state_record(step=1, stage=0, records=0, counters={}, loader=None, seed=0)
    experiment = {"format": ckpt.FORMAT, "params": []}

    root = tempfile.mkdtemp(prefix="sexpgpu-bench-", dir=args.dir)
    try:
        storage = open_location(os.path.join(root, "ckpt"))
        baseline_path = os.path.join(root, "baseline.safetensors")

        def ours(arrays) -> None:
            ckpt.write_checkpoint(storage, 1, arrays, {}, state, experiment)

        def baseline(sync: bool) -> None:
            save_file(tensors, baseline_path)
            if sync:
                fd = os.open(baseline_path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

        times: dict[str, list[float]] = {"ours": [], "laid": [], "synced": [], "plain": []}
        for _ in range(args.repeats):
            for name, job in (
                ("ours", lambda: ours(params)),
                ("laid", lambda: ours(laid_out)),
                ("synced", lambda: baseline(True)),
                ("plain", lambda: baseline(False)),
            ):
                started = time.perf_counter()
                job()
                times[name].append(time.perf_counter() - started)
                os.sync()  # nothing of one measurement is left for the next to flush
        median = {name: min(values) for name, values in times.items()}
        print(f"model: {args.tensors} tensors, {megabytes:.0f} MB, folder {root}")
        print(f"write_checkpoint, plain arrays         {median['ours']:.3f} s")
        print(f"write_checkpoint, layout_tensors       {median['laid']:.3f} s")
        print(f"safetensors.torch.save_file + fsync    {median['synced']:.3f} s")
        print(f"safetensors.torch.save_file, no fsync  {median['plain']:.3f} s")
        for name, label in (("ours", "plain arrays"), ("laid", "layout_tensors")):
            print(
                f"ratio {label:<14} vs save_file + fsync {median[name] / median['synced']:.2f}"
                f", vs no fsync {median[name] / median['plain']:.2f} (goal <= 1.1)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
