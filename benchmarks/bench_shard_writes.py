"""Two ways to write a fully sharded checkpoint (``:shard full``), timed and weighed.

Every rank holds rows of each tensor (``torch.chunk`` along the first axis, as FSDP2
cuts). The checkpoint's file must hold every tensor whole. Two ways:

- **gathered** (what ``sexpgpu_torch`` does): each tensor gathered whole, one at a time,
  copied by rank 0 into the file's layout (``sexpgpu.checkpoint.layout_tensors``), which
  rank 0 then writes in one go and fsyncs;
- **ranged**: rank 0 writes the file's header and sizes it; each rank writes its own rows of
  each tensor, one contiguous byte range per tensor, at their offsets (``os.pwrite``), and
  fsyncs; nobody gathers anything. Only a folder can take it: an object store takes no
  write at an offset (S3's multipart parts are >= 5 MB and these ranges interleave).

The tensors: tiny-lm's at ``--dim`` and ``--layers`` (50.4M parameters at 1024 and 4) and two
optimizer states each, in one file, on two gloo ranks (one process each, started by this
script). Each way runs ``--repeats`` times, alternating; each repeat's files are compared
byte for byte. Prints the median seconds with the spread, and each way's largest growth of
a rank's resident set during the write (peak RSS after the write less RSS before it; the
peak is reset first through ``/proc/self/clear_refs``).

    python benchmarks/bench_shard_writes.py [--repeats 3] [--dim 1024] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("gathered", "ranged")


def shapes(dim: int, layers: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors: every parameter of tiny-lm and its two adam states."""
    from sexpgpu.catalog import Catalog
    from sexpgpu.session import Selection

    sets = {"dim": str(dim), "layers": str(layers)}
    program = Selection(str(ROOT / "examples" / "tiny-lm.sx"), sets=sets).compile(Catalog.load())
    found = {}
    for decl in program.params:
        for suffix in ("", "/m", "/v"):
            found[decl.path + suffix] = tuple(decl.type.shape)
    return found


def _status(key: str) -> int:
    """A field of /proc/self/status in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def worker(way: str, rank: int, port: int, path: str, dim: int, layers: int) -> None:
    """One rank: its rows of every tensor, then the write, timed; prints a JSON line."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from sexpgpu.checkpoint import layout_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    specs = shapes(dim, layers)
    mine = {}
    for index, (name, shape) in enumerate(specs.items()):  # the same whole tensors on each rank
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(index))
        chunks = torch.chunk(whole.reshape(shape[0] if shape else 1, -1), 2, dim=0)
        mine[name] = chunks[rank].clone() if rank < len(chunks) else whole.new_empty((0,))
        del whole
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before = _status("VmRSS")
    started = time.perf_counter()
    if way == "gathered":
        out = layout_tensors({n: (s, "float32") for n, s in specs.items()}) if rank == 0 else {}
        for name, shape in specs.items():
            rows = shape[0] if shape else 1
            width = mine[name].numel() // max(1, mine[name].shape[0]) if mine[name].numel() else 0
            biggest = -(-rows // 2)
            padded = torch.zeros(biggest * max(width, 1))
            padded[: mine[name].numel()] = mine[name].reshape(-1)
            parts = [torch.empty_like(padded) for _ in range(2)]
            dist.all_gather(parts, padded)
            if rank == 0:
                sizes = [c.numel() for c in torch.chunk(torch.empty(rows), 2)]
                row = math.prod(shape[1:]) if shape else 1
                whole = torch.cat([p[: n * row] for p, n in zip(parts, sizes, strict=False)])
                out[name][...] = whole.reshape(shape).numpy()
        if rank == 0:
            buffer = _root_buffer(next(iter(out.values())))
            with open(path, "wb") as f:
                f.write(memoryview(buffer))
                f.flush()
                os.fsync(f.fileno())
    else:
        out = layout_tensors({n: (s, "float32") for n, s in specs.items()})  # offsets only
        buffer = _root_buffer(next(iter(out.values())))
        base = buffer.__array_interface__["data"][0]
        if rank == 0:
            first = min(a.__array_interface__["data"][0] for a in out.values()) - base
            with open(path, "wb") as f:
                f.write(memoryview(buffer[:first]))
                f.truncate(buffer.nbytes)
        dist.barrier()
        fd = os.open(path, os.O_WRONLY)
        try:
            for name, shape in specs.items():
                rows = shape[0] if shape else 1
                sizes = [c.numel() for c in torch.chunk(torch.empty(rows), 2)]
                row_bytes = 4 * (math.prod(shape[1:]) if shape else 1)
                start = (
                    out[name].__array_interface__["data"][0] - base + sum(sizes[:rank]) * row_bytes
                )
                data = np.ascontiguousarray(mine[name].numpy())
                if data.nbytes:
                    os.pwrite(fd, memoryview(data).cast("B"), start)
            os.fsync(fd)
        finally:
            os.close(fd)
        dist.barrier()
    seconds = time.perf_counter() - started
    grown = _status("VmHWM") - before
    print(json.dumps({"rank": rank, "seconds": seconds, "grown_mb": grown / 1024}), flush=True)
    dist.destroy_process_group()


def _root_buffer(array):  # noqa: ANN001, ANN202 - numpy
    while array.base is not None and hasattr(array.base, "base"):
        array = array.base
    return array


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(way: str, path: Path, dim: int, layers: int) -> tuple[float, float]:
    """Seconds (the slower rank's) and the larger growth of a rank's resident set."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", way, "--rank", str(r), "--port", str(port)]
            + ["--path", str(path), "--dim", str(dim), "--layers", str(layers)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    lines = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return max(x["seconds"] for x in lines), max(x["grown_mb"] for x in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(
            options.worker, options.rank, options.port, options.path, options.dim, options.layers
        )
        return
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(options.repeats):
            written = {}
            for way in WAYS if repeat % 2 == 0 else reversed(WAYS):
                written[way] = Path(folder) / f"{way}-{repeat}.safetensors"
                results[way].append(one(way, written[way], options.dim, options.layers))
            same = written["gathered"].read_bytes() == written["ranged"].read_bytes()
            assert same, "the two ways wrote different files"
            for path in written.values():
                path.unlink()
    size = sum(math.prod(s) for s in shapes(options.dim, options.layers).values()) * 4 / 1e6
    print(f"one file of {size:.0f} MB (parameters and two states), two gloo ranks:")
    for way, runs in results.items():
        seconds = [s for s, _ in runs]
        grown = [g for _, g in runs]
        print(
            f"  {way:9s} {statistics.median(seconds):6.2f} s ({min(seconds):.2f}-{max(seconds):.2f})"
            f"   a rank's resident set grew by up to {max(grown):6.0f} MB"
        )


if __name__ == "__main__":
    main()
