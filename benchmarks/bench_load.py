"""Reading a frozen teacher from a safetensors file, against ``safetensors.torch.load_file``.

Local: writes a ~400 MB file (100 tensors of 1M f32) and, each in a fresh process so
that peak resident memory is its own, times

    baseline  safetensors.torch.load_file(path), each tensor cloned: tensors of
              their own, as a trainer holds its parameters (load_file alone only
              maps the file)
    ours      what `sexpgpu run` does before its first step: read the headers, the
              file's identity (its sha256, streamed), every tensor with one ranged
              read each, and hand them to the torch trainer (set_params)

and prints each one's best and median time and peak resident memory (goal: time
<= 1.2x the baseline; peak memory <= the file size + the model). The page cache is
warmed first, so both read from memory, as a second run of the same job would.

Bucket: stores a file of 20 tensors of 1 MB on moto's S3 server (started on
127.0.0.1 by this script), reads half of them through a byte-counting forwarder,
and prints the bytes that crossed the wire against the file's size.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_load.py [--tensors 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = r"""
import json, resource, sys, time
path, which, count, elements = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import numpy as np, torch
start = time.perf_counter()
if which == "baseline":
    from safetensors.torch import load_file
    # load_file maps the file; a trainer owns its parameters, so each is copied out
    tensors = {name: t.clone() for name, t in load_file(path).items()}
    assert len(tensors) == count
else:
    from sexpgpu.errors import Pos
    from sexpgpu.lang.ir import Init, LoadSpec, ParamDecl, Program, TensorType
    from sexpgpu.catalog import Catalog
    from sexpgpu.checkpoint.loads import Loads
    from sexpgpu_torch.trainer import TorchTrainer
    decls = [
        ParamDecl(f"teacher.w{i}", TensorType((elements,), "f32"), Init("zeros", ()), False, (),
                  LoadSpec(path, f"w{i}"), Pos("bench.sx", 1, 1))
        for i in range(count)
    ]
    loads = Loads(decls, Catalog.load().open_location)
    loads.check()
    loads.prefetch_identities()  # as a run does: the sha256 while the tensors are read
    trainer = TorchTrainer.__new__(TorchTrainer)  # only the parameter store is needed
    trainer._decl_by_path = {d.path: d for d in decls}
    trainer.params, trainer.device = {}, torch.device("cpu")
    trainer.set_params(loads.read())
    loads.identities()
    assert len(trainer.params) == count
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak": peak}))
"""


def child(path: Path, which: str, count: int, elements: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), which, str(count), str(elements)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout)


def idle_peak() -> int:
    """The peak memory of a child that imports what both sides import and reads nothing."""
    code = (
        "import resource, numpy, torch, safetensors.torch, sexpgpu.checkpoint.loads, sexpgpu_torch.graphs;"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(out.stdout)


def local(args: argparse.Namespace, folder: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    path = folder / "teacher.safetensors"
    rng = np.random.default_rng(0)
    save_file(
        {
            f"w{i}": rng.standard_normal(args.elements, dtype=np.float32)
            for i in range(args.tensors)
        },
        str(path),
    )
    size = path.stat().st_size
    path.read_bytes()  # warm the page cache
    runs: dict[str, list[dict]] = {"baseline": [], "ours": []}
    for _ in range(args.repeats):
        for which in runs:  # alternating, so a noisy machine hurts both alike
            runs[which].append(child(path, which, args.tensors, args.elements))
    base = idle_peak()
    print(
        f"local file: {size / 1e6:.0f} MB, {args.tensors} tensors; idle process {base / 1e6:.0f} MB"
    )
    for which, results in runs.items():
        times = sorted(r["seconds"] for r in results)
        peak = max(r["peak"] for r in results)
        print(
            f"  {which:8}  best {times[0]:.3f} s  median {statistics.median(times):.3f} s  "
            f"peak {peak / 1e6:.0f} MB (above idle: {(peak - base) / 1e6:.0f} MB)"
        )
    best = {w: min(r["seconds"] for r in rs) for w, rs in runs.items()}
    median = {w: statistics.median(r["seconds"] for r in rs) for w, rs in runs.items()}
    print(
        f"  ours / baseline: best {best['ours'] / best['baseline']:.2f}x, "
        f"median {median['ours'] / median['baseline']:.2f}x (goal <= 1.2); "
        f"memory goal: peak above idle <= {2 * size / 1e6:.0f} MB (file + model)"
    )


def bucket(folder: Path) -> None:
    import boto3
    import numpy as np
    from safetensors.numpy import save_file

    from tests.servers import CountingProxy, start_moto

    (folder / "moto-log").mkdir()
    server = start_moto(folder / "moto-log")
    try:
        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        client = boto3.client("s3", endpoint_url=server.url)
        client.create_bucket(Bucket="bench")
        rng = np.random.default_rng(1)
        path = folder / "half.safetensors"
        save_file(
            {f"w{i}": rng.standard_normal(256 * 1024, dtype=np.float32) for i in range(20)},
            str(path),
        )
        client.put_object(Bucket="bench", Key="m/half.safetensors", Body=path.read_bytes())
        proxy = CountingProxy(server.port).start()
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url
        from sexpgpu.catalog import Catalog
        from sexpgpu.checkpoint.loads import Loads
        from sexpgpu.errors import Pos
        from sexpgpu.lang.ir import Init, LoadSpec, ParamDecl, TensorType

        decls = [
            ParamDecl(
                f"teacher.w{i}",
                TensorType((256 * 1024,), "f32"),
                Init("zeros", ()),
                False,
                (),
                LoadSpec("s3://bench/m/half.safetensors", f"w{i}"),
                Pos("bench.sx", 1, 1),
            )
            for i in range(0, 20, 2)
        ]
        loads = Loads(decls, Catalog.load().open_location)
        loads.check()
        loads.identities()
        values = loads.read()
        proxy.stop()
        assert len(values) == 10
        size = path.stat().st_size
        print(
            f"bucket: a program using 10 of 20 tensors of a {size / 1e6:.1f} MB S3 object: "
            f"{proxy.downstream / 1e6:.2f} MB received, {proxy.upstream / 1e3:.1f} kB sent "
            f"({proxy.downstream / size:.0%} of the object)"
        )
    finally:
        server.stop()


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--elements", type=int, default=1_000_000, help="per tensor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        local(args, Path(tmp))
        bucket(Path(tmp))


if __name__ == "__main__":
    main()
