"""Bundles against what they stand for: a compiled bundle's replay against a cold
compile, writing a bundle against copying its files, and reading one against a copy.

    .venv/bin/python benchmarks/bench_bundle.py [--repeats 5] [--file examples/my-run.sx]
        [--load-mb 400] [--no-s3] [--dir FOLDER]

Each measure is the median of ``--repeats`` runs with the fastest and the slowest,
the two sides of each comparison alternating so both see the same machine load:

1. ``sexpgpu run FILE --lowering compiled`` with an empty ``TORCHINDUCTOR_CACHE_DIR``
   (torch's default folder outlives a process, so it is never left unset) against
   ``sexpgpu run X.sxb`` (the bundle, made once with ``--lowering compiled``, brings
   its own caches), each with its own empty ``TMPDIR`` (inductor keeps headers
   there) and ``OMP_NUM_THREADS=1``, ``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set:
   ``compile_seconds`` of the ``run started`` log record and the process's wall time
   (goal: replay / cold <= 0.20).
2. ``sexpgpu bundle big.sx`` (eager; a ``.sx`` that ``:load``s a ``--load-mb`` MB
   safetensors file) against copying the same files to the same disk
   (``shutil.copyfile`` and an fsync of each), against copying and a sha256 of each
   (any checksummed copy), and ``archive.write_bundle`` alone in this process, with
   and without the hashes the command hands it (its run's one pass read them)
   (goal: the command <= 1.2x the copy). ``sexpgpu bundle --show`` of the result is
   the floor a command's start-up puts under it.
3. ``opening.unpack`` of that bundle into a new folder against ``shutil.copyfile``
   and a sha256 of it; and from moto's S3 server on loopback against boto3's
   ``download_file`` and a sha256 (skipped without boto3 or moto, or with ``--no-s3``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DIM, VOCAB = 8, 32
S3_UNSET = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "SEXPGPU_CHECKPOINT_PROFILE")
PROGRAM = f"""(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02) :load (file "big.safetensors" "head"))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 32 :batch 16)
(defrun big :model (net {VOCAB} {DIM}) :data train
  :loss (cross-entropy (model inputs) targets) :optimizer (adam :lr 0.01) :steps 2)
"""


def _tool(name: str) -> str | None:
    """The venv's script ``name``, else the one on PATH, else ``None``."""
    return str(BIN / name) if (BIN / name).exists() else shutil.which(name)


def _env(changes: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with one CPU thread (unless set) and ``changes``
    applied (``None`` removes a name)."""
    merged = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", **os.environ}
    return {k: v for k, v in {**merged, **changes}.items() if v is not None}


def _sexpgpu(args: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[float, str]:
    """Run ``sexpgpu ARGS``; its wall seconds and its stderr then stdout. Exits on failure."""
    started = time.perf_counter()
    command = [_tool("sexpgpu") or "sexpgpu", *args]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"sexpgpu {' '.join(args)} failed:\n{(done.stderr + done.stdout)[-3000:]}")
    return wall, done.stderr + done.stdout


def _compile_seconds(output: str) -> float:
    """``compile_seconds`` of the JSON log record ``run started`` in ``output``."""
    for line in output.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "run started":
            if "compile_seconds" in record:
                return float(record["compile_seconds"])
    sys.exit(f"no 'run started' record with compile_seconds in:\n{output[-3000:]}")


def _timed(job: Callable[[], object]) -> float:
    """Seconds ``job()`` takes."""
    started = time.perf_counter()
    job()
    return time.perf_counter() - started


def _sha256(path: Path) -> str:
    """The sha256 of the file ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _copy(sources: list[Path], folder: Path, *, digest: bool, sync: bool) -> None:
    """Copy ``sources`` into ``folder`` with ``shutil.copyfile``, each then hashed
    (``digest``) and fsynced (``sync``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in sources:
        target = folder / source.name
        shutil.copyfile(source, target)
        if digest:
            _sha256(target)
        if sync:
            with open(target, "rb") as handle:
                os.fsync(handle.fileno())


def _clear(*paths: Path) -> None:
    """Remove ``paths`` (files or folders) and flush the disk, so that no measure
    pays for another's writes."""
    for path in paths:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    os.sync()


def _line(name: str, values: list[float]) -> None:
    """Print one measure: its median, fastest and slowest."""
    print(
        f"  {name:<42} median {statistics.median(values):8.3f} s"
        f"  ({min(values):.3f}..{max(values):.3f})"
    )


def _ratio(name: str, ours: list[float], base: list[float], goal: str = "") -> None:
    """Print the ratio of the medians and of the fastest runs of two measures."""
    median = statistics.median(ours) / statistics.median(base)
    print(f"  ratio {name:<36} median {median:.2f}, fastest {min(ours) / min(base):.2f}{goal}")


def bench_replay(program: Path, work: Path, repeats: int) -> None:
    """Part 1: ``sexpgpu run`` of a compiled bundle against a cold compile of the file."""
    bundle = work / "replay.sxb"
    (work / "bundling" / "tmp").mkdir(parents=True)
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(work / "bundling" / "inductor")}
    made, _ = _sexpgpu(
        ["bundle", str(program), "--lowering", "compiled", "-o", str(bundle)],
        _env({**cache, "TMPDIR": str(work / "bundling" / "tmp")}),
    )
    names = ("cold compile_seconds", "replay compile_seconds", "cold wall", "replay wall")
    times: dict[str, list[float]] = {name: [] for name in names}
    for run in range(repeats):
        for side in ("cold", "replay"):
            folder = work / f"{side}-{run}"
            (folder / "tmp").mkdir(parents=True)
            changes: dict[str, str | None] = {"TMPDIR": str(folder / "tmp")}
            if side == "cold":
                target, options = str(program), ["--lowering", "compiled"]
                changes["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
            else:  # the bundle sets the caches' folders itself
                target, options = str(bundle), []
                changes.update(TORCHINDUCTOR_CACHE_DIR=None, TRITON_CACHE_DIR=None)
            wall, output = _sexpgpu(
                ["run", target, *options, "--checkpoint-dir", str(folder / "ck")]
                + ["--metrics-dir", str(folder / "metrics"), "--log-format", "json"],
                _env(changes),
            )
            times[f"{side} compile_seconds"].append(_compile_seconds(output))
            times[f"{side} wall"].append(wall)
            shutil.rmtree(folder)
    print(f"1. replay against cold compile: {program.name}, {repeats} runs each")
    print(f"  (bundle made in {made:.1f} s, {bundle.stat().st_size / 1e6:.1f} MB)")
    for name, values in times.items():
        _line(name.replace("wall", "process wall"), values)
    replay, cold = times["replay compile_seconds"], times["cold compile_seconds"]
    _ratio("replay / cold compile_seconds", replay, cold, " (goal <= 0.20)")
    _ratio("replay / cold process wall", times["replay wall"], times["cold wall"])


def _make_project(folder: Path, megabytes: int) -> tuple[Path, Path]:
    """A folder holding ``big.sx`` and the ``megabytes`` MB ``big.safetensors`` it loads."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    head = rng.standard_normal((DIM, VOCAB), dtype=np.float32)
    padding = rng.standard_normal(max(1, megabytes * 250_000 - head.size), dtype=np.float32)
    save_file({"head": head, "padding": padding}, str(folder / "big.safetensors"))
    (folder / "big.sx").write_text(PROGRAM)
    return folder / "big.sx", folder / "big.safetensors"


def bench_write(work: Path, megabytes: int, repeats: int) -> Path:
    """Part 2: ``sexpgpu bundle`` and ``write_bundle`` against copying the files; returns
    the bundle the command wrote."""
    from sexpgpu_bundle.archive import identify, write_bundle

    project = work / "project"
    sx, weights = _make_project(project, megabytes)
    out, written, copied = project / "out.sxb", work / "writer.sxb", work / "copied"
    members: dict[str, bytes | Path] = {"sources/big.sx": sx, "sources/big.safetensors": weights}
    manifest = {  # the least the schema takes; the writer adds format and members
        "created": "2024-01-01T00:00:00Z", "main": "sources/big.sx", "sources": [], "loads": [],
        "data_files": [], "selection": {"variant": None, "knobs": []}, "choices": {},
        "versions": {"sexpgpu": "bench", "libraries": {}, "plugins": {}}, "machine": {},
        "compiled": None,
    }  # fmt: skip
    env = _env({"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")})
    cli, show, plain, summed, writer, hashed = (
        "sexpgpu bundle", "sexpgpu bundle --show", "copyfile + fsync",
        "copyfile + sha256 + fsync", "write_bundle (in process)",
        "write_bundle, hashes known",
    )  # fmt: skip
    # what the command hands the writer: the run's one pass hashed the :load file
    known = {name: identify(path) for name, path in members.items()}
    jobs: list[tuple[str, Path | None, Callable[[], object]]] = [
        (cli, out, lambda: _sexpgpu(["bundle", "big.sx", "-o", "out.sxb"], env, project)),
        (show, None, lambda: _sexpgpu(["bundle", "--show", str(out)], env)),
        (plain, copied, lambda: _copy([sx, weights], copied, digest=False, sync=True)),
        (summed, copied, lambda: _copy([sx, weights], copied, digest=True, sync=True)),
        (writer, written, lambda: write_bundle(written, manifest, members)),
        (hashed, written, lambda: write_bundle(written, manifest, members, known=known)),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in jobs}
    for _ in range(repeats):
        for name, target, job in jobs:
            _clear(*([target] if target else []))
            times[name].append(_timed(job))
    _clear(copied, written)
    size = sum(p.stat().st_size for p in (sx, weights)) / 1e6
    print(f"2. writing a bundle against copying its files: {size:.0f} MB, {repeats} runs each")
    for name, values in times.items():
        _line(name, values)
    _ratio("sexpgpu bundle / copy", times[cli], times[plain], " (goal <= 1.2)")
    _ratio("sexpgpu bundle / copy + sha256", times[cli], times[summed])
    _ratio("write_bundle / copy", times[writer], times[plain])
    _ratio("write_bundle / copy + sha256", times[writer], times[summed])
    _ratio("write_bundle, hashes known / copy + sha256", times[hashed], times[summed])
    floor = statistics.median(times[show])
    print(f"  start-up floor: bundle --show takes {floor:.3f} s (median) of any command's time")
    return out


def _read_side(
    name: str, unpack: Callable[[], object], copy: Callable[[], object], paths: list[Path],
    repeats: int,
) -> None:  # fmt: skip
    """Time ``unpack`` against ``copy`` alternately, clearing ``paths`` before each; print."""
    ours: list[float] = []
    base: list[float] = []
    for _ in range(repeats):
        _clear(*paths)
        ours.append(_timed(unpack))
        _clear(*paths)
        base.append(_timed(copy))
    _clear(*paths)
    _line(f"unpack, {name}", ours)
    _line(f"{'download_file' if name == 's3' else 'copyfile'} + sha256, {name}", base)
    _ratio(f"unpack / copy, {name}", ours, base)


def bench_read(bundle: Path, work: Path, repeats: int, s3: bool) -> None:
    """Part 3: ``opening.unpack`` of ``bundle``, local and from S3, against a plain copy."""
    from sexpgpu.catalog import Catalog
    from sexpgpu_bundle.opening import unpack

    work.mkdir(parents=True)
    open_location = Catalog.load().open_location
    into, copied = work / "unpacked", work / "copied.sxb"
    fetched = work / "unpacked.sxb"  # where unpack puts a bundle it fetches

    def copy() -> None:
        shutil.copyfile(bundle, copied)
        _sha256(copied)

    print(f"3. reading a bundle: {bundle.stat().st_size / 1e6:.0f} MB, {repeats} runs each")
    _read_side(
        "local", partial(unpack, str(bundle), into, open_location), copy, [into, copied], repeats
    )
    moto = _tool("moto_server")
    if not s3 or moto is None or importlib.util.find_spec("boto3") is None:
        print("  s3: skipped (" + ("--no-s3" if not s3 else "boto3 or moto not installed") + ")")
        return
    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url, bucket = f"http://127.0.0.1:{port}", "sexpgpu-bench"
    for name in S3_UNSET:
        os.environ.pop(name, None)
    # boto3 (here and in the storage plugin) to moto, with test keys and no user config
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
        AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL_S3=url, AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(work / "none"), AWS_SHARED_CREDENTIALS_FILE=str(work / "none"),
    )  # fmt: skip
    with open(work / "moto.log", "wb") as log:
        server = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"moto_server did not start; see {work / 'moto.log'}")
                time.sleep(0.1)
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket=bucket)
        client.upload_file(str(bundle), bucket, "out.sxb")

        def download() -> None:  # a new client each time, as unpack opens a new one
            boto3.client("s3", endpoint_url=url).download_file(bucket, "out.sxb", str(copied))
            _sha256(copied)

        remote = partial(unpack, f"s3://{bucket}/out.sxb", into, open_location)
        _read_side("s3", remote, download, [into, fetched, copied], repeats)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    """Run the three comparisons and print one line per measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--file", default=str(ROOT / "examples" / "my-run.sx"))
    parser.add_argument("--load-mb", type=int, default=400, help="size of the :load file")
    parser.add_argument("--no-s3", action="store_true", help="skip reading from S3")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sexpgpu-bundle-bench-", dir=args.dir))
    try:
        bench_replay(Path(args.file).resolve(), work / "replay", args.repeats)
        bundle = bench_write(work / "write", args.load_mb, args.repeats)
        bench_read(bundle, work / "read", args.repeats, not args.no_s3)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
