"""Checkpoint write speed against plain PyTorch + safetensors on the same disk.

Writes a ~200 MB model (50 tensors of 1M f32) with ``write_checkpoint`` through the
local storage backend (checksums included: each file's CRC32C is computed while it is
written and recorded in experiment.json), and the same tensors with
``safetensors.torch.save_file`` into the same folder, alternating, each into new files as a run writes them, and prints each
one's median, fastest and slowest run and the ratios of the medians and of the
fastest runs (goal: <= 1.1): on a shared machine the fastest run is the one least
disturbed, the median the typical one. The local backend makes every file durable (fsync, rename, fsync of the
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
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure")
    args = parser.parse_args()

    import numpy as np
    import torch
    from safetensors.torch import save_file

    from sexpgpu import checkpoint as ckpt
    from sexpgpu.catalog import Catalog

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
        storage = Catalog.load().open_location(os.path.join(root, "ckpt"))
        baseline_path = os.path.join(root, "baseline.safetensors")

        def ours(arrays, step: int) -> None:
            ckpt.write_checkpoint(storage, step, arrays, {}, state, experiment)

        def baseline(sync: bool, step: int) -> None:
            path = f"{baseline_path}-{step}"
            save_file(tensors, path)
            if sync:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

        def clear() -> None:
            # As in a run, each write makes new files: freeing the previous one's disk
            # blocks (a rename or truncation over it) is no part of the measurement.
            for name in os.listdir(root):
                path = os.path.join(root, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            os.sync()  # nothing of one measurement is left for the next to flush

        times: dict[str, list[float]] = {"ours": [], "laid": [], "synced": [], "plain": []}
        for run in range(args.repeats):
            for name, job, arg in (
                ("ours", lambda a: ours(params, a), run + 1),
                ("laid", lambda a: ours(laid_out, a), run + 1),
                ("synced", lambda a: baseline(True, a), run),
                ("plain", lambda a: baseline(False, a), run),
            ):
                clear()
                started = time.perf_counter()
                job(arg)
                times[name].append(time.perf_counter() - started)
        clear()
        import statistics

        median = {name: statistics.median(values) for name, values in times.items()}
        fastest = {name: min(values) for name, values in times.items()}
        print(f"model: {args.tensors} tensors, {megabytes:.0f} MB, {args.repeats} runs each")
        for name, label in (
            ("ours", "write_checkpoint, plain arrays"),
            ("laid", "write_checkpoint, layout_tensors"),
            ("synced", "safetensors.torch.save_file + fsync"),
            ("plain", "safetensors.torch.save_file, no fsync"),
        ):
            values = times[name]
            print(
                f"{label:<38} median {median[name]:.3f} s  "
                f"(fastest {min(values):.3f}, slowest {max(values):.3f})"
            )
        for name, label in (("ours", "plain arrays"), ("laid", "layout_tensors")):
            print(
                f"ratio {label:<14} vs save_file + fsync: median {median[name] / median['synced']:.2f}"
                f", fastest {fastest[name] / fastest['synced']:.2f}"
                f"; vs no fsync: median {median[name] / median['plain']:.2f} (goal <= 1.1)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
