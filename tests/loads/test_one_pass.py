"""A local :load file is read once: its tensors and its sha256 in one pass, the
identity the same as the local backend's, so checkpoints pinned before still resume."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file

from sexpgpu.checkpoint.loads import Loads
from sexpgpu.errors import Pos, SexpError
from sexpgpu.lang.ir import Init, LoadSpec, ParamDecl, TensorType
from tests.catalogs import open_location
from tests.e2e.helpers import sexpgpu_env

POS = Pos("model.sx", 3, 10)


def decl(path: str, shape: tuple[int, ...], uri: str, tensor: str, trainable: bool = False):
    return ParamDecl(
        path, TensorType(shape, "f32"), Init("zeros", ()), trainable, (), LoadSpec(uri, tensor), POS
    )


class Counting:
    """The local backend, counting the bytes every kind of read takes from the file."""

    def __init__(self, inner) -> None:
        self.inner, self.bytes, self.identities = inner, 0, 0

    def read_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.read_range(key, start, length)
        self.bytes += len(data)
        return data

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        got = self.inner.read_range_into(key, start, buffer)
        self.bytes += got
        return got

    def identity(self, key: str):
        self.identities += 1
        identity = self.inner.identity(key)
        self.bytes += identity.size
        return identity


def big_file(folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A file of several chunks, with a tensor no parameter reads between the others."""
    rng = np.random.default_rng(3)
    tensors = {
        "a": rng.standard_normal((3, 1000, 1000), dtype=np.float32),  # 12 MB: two chunks
        "b": rng.standard_normal((700, 1000), dtype=np.float32),
        "skipped": rng.standard_normal((2_500_000,), dtype=np.float32),
        "c": rng.standard_normal((5,), dtype=np.float32),
    }
    path = folder / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def opened(path: Path, names: dict[str, tuple[int, ...]]) -> tuple[Loads, Counting]:
    loads = Loads(
        open_location=open_location,
        params=[decl(f"model.{n}", shape, str(path), n) for n, shape in names.items()],
    )
    loads.check()
    file = loads._files[str(path)]
    file.storage = counting = Counting(file.storage)
    return loads, counting


def test_the_tensors_and_the_identity_are_one_pass_over_the_file(tmp_path: Path) -> None:
    path, tensors = big_file(tmp_path)
    loads, counting = opened(path, {n: tensors[n].shape for n in ("a", "b", "c")})
    values = loads.read()
    pinned = loads.identities()
    assert loads.identities() == pinned
    # every byte once, the header and the tensor no parameter reads included, and the
    # backend's separate hashing pass never run
    assert counting.bytes == path.stat().st_size
    assert counting.identities == 0
    for name in ("a", "b", "c"):
        np.testing.assert_array_equal(values[f"model.{name}"], tensors[name])
        assert values[f"model.{name}"].flags.writeable  # the trainer takes it as it is
    # the identity is the one the local backend gives, as checkpoints pinned it before
    storage = open_location(str(tmp_path))
    identity = storage.identity("w.safetensors")
    assert pinned["model.a"]["size"] == identity.size == path.stat().st_size
    assert pinned["model.a"]["version"] == identity.version
    assert identity.version == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_prefetch_reads_the_file_once_and_read_hands_over_what_it_asks(tmp_path: Path) -> None:
    path, tensors = big_file(tmp_path)
    loads, counting = opened(path, {n: tensors[n].shape for n in ("a", "b")})
    loads.prefetch_identities()
    values = loads.read(["model.b"])  # a resume reads only the frozen parameters
    assert list(values) == ["model.b"]
    np.testing.assert_array_equal(values["model.b"], tensors["b"])
    assert loads._values == {}  # model.a, read by the pass, is not kept for the run
    assert loads.identities()["model.a"]["size"] == path.stat().st_size
    assert counting.bytes == path.stat().st_size


def test_identities_alone_hash_without_keeping_tensors(tmp_path: Path) -> None:
    path, tensors = big_file(tmp_path)
    loads, counting = opened(path, {"c": (5,)})
    pinned = loads.identities()
    assert pinned["model.c"]["version"].startswith("sha256:")
    assert loads._values == {}
    np.testing.assert_array_equal(loads.read()["model.c"], tensors["c"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_floats_read_in_the_pass_widen_exactly(tmp_path: Path, dtype) -> None:
    values = torch.randn(40, 50).to(dtype)
    save_torch_file({"w": values, "x": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    loads, counting = opened(tmp_path / "w.safetensors", {"w": (40, 50)})
    got = loads.read()["model.w"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values.to(torch.float32).numpy())
    assert counting.bytes == (tmp_path / "w.safetensors").stat().st_size


def test_two_parameters_read_from_one_tensor_are_two_arrays(tmp_path: Path) -> None:
    save_file({"w": np.arange(6, dtype=np.float32)}, str(tmp_path / "w.safetensors"))
    uri = str(tmp_path / "w.safetensors")
    loads = Loads(
        open_location=open_location,
        params=[decl("model.a", (6,), uri, "w"), decl("model.b", (6,), uri, "w")],
    )
    loads.check()
    values = loads.read()
    assert not np.shares_memory(values["model.a"], values["model.b"])
    values["model.b"][0] = 99.0  # the second is a copy of its own, the trainer's to update
    np.testing.assert_array_equal(values["model.a"], np.arange(6, dtype=np.float32))


def test_a_file_that_changes_during_the_pass_is_refused(tmp_path: Path) -> None:
    path, tensors = big_file(tmp_path)
    loads, counting = opened(path, {"a": tensors["a"].shape})
    real = counting.read_range_into
    calls = []

    def rewrite_after_the_first_chunk(key: str, start: int, buffer: memoryview) -> int:
        got = real(key, start, buffer)
        if not calls:
            with open(path, "r+b") as f:  # same size, same header: other bytes
                f.seek(-4, os.SEEK_END)
                f.write(b"\x00\x00\x80\x7f")
            stat = path.stat()
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        calls.append(start)
        return got

    counting.read_range_into = rewrite_after_the_first_chunk
    loads.read()  # the values are read; the hash that pins them finds the change
    with pytest.raises(SexpError) as caught:
        loads.identities()
    assert caught.value.code == "E-LOAD-005"
    assert caught.value.pos == POS


def test_tensors_claiming_the_same_bytes_are_refused(tmp_path: Path) -> None:
    header = (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    )
    (tmp_path / "w.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    loads = Loads(
        open_location=open_location,
        params=[decl("model.a", (2,), str(tmp_path / "w.safetensors"), "a")],
    )
    with pytest.raises(SexpError) as caught:
        loads.check()
    assert caught.value.code == "E-LOAD-002"
    assert "b's bytes overlap a's" in caught.value.message


# A run whose frozen parameter is read from a file of a size the test picks; the
# process reports at exit the bytes its reads returned (/proc/self/io's rchar),
# the page cache's included.
BIG_PROGRAM = """\
(defmodel net (vocab dim n)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (param big [n] :frozen true :load (file "big.safetensors" "big"))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 16 :batch 2)
(defrun once :model (net 32 8 {n}) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1) :steps 1 :seed 1
  :evals ((eval probe :every 1 :batches 1 :metrics (loss))))
"""
COUNTING_SEXPGPU = """\
import atexit, sys
atexit.register(lambda: print("rchar", open("/proc/self/io").read().split()[1], file=sys.stderr))
from sexpgpu_cli.main import main
main()
"""


def bytes_read(folder: Path, *args: str) -> int:
    """What ``sexpgpu ARGS`` in ``folder`` read, its page cache's bytes included."""
    done = subprocess.run(
        [sys.executable, "-c", COUNTING_SEXPGPU, *args, "--metrics-dir", "metrics"],
        cwd=folder,
        env=sexpgpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("rchar ")]
    return int(line.split()[1])


def bytes_a_run_reads(folder: Path, n: int) -> int:
    folder.mkdir()
    save_file({"big": np.ones(n, np.float32)}, str(folder / "big.safetensors"))
    (folder / "big.sx").write_text(BIG_PROGRAM.format(n=n))
    return bytes_read(folder, "run", "big.sx", "--checkpoint-dir", "ckpt")


def test_a_run_reads_its_teacher_once(tmp_path: Path) -> None:
    # Two runs alike but for the size of the file; what the second reads beyond the
    # first is that file's extra bytes once (the sha256 and the tensor from one
    # pass), where a hashing pass and the tensor's own read took them twice.
    small, large = 16, 8 << 20
    extra = (large - small) * 4
    more = bytes_a_run_reads(tmp_path / "large", large) - bytes_a_run_reads(
        tmp_path / "small", small
    )
    assert extra <= more < 1.25 * extra
    # and so does evaluate, which reads the frozen teacher the checkpoint pins
    more = bytes_read(tmp_path / "large", "evaluate", "ckpt/latest") - bytes_read(
        tmp_path / "small", "evaluate", "ckpt/latest"
    )
    assert extra <= more < 1.25 * extra


class _HeldSha256:
    """sha256 whose every update waits for ``gate``: a hash far behind the read."""

    gate = threading.Event()

    def __init__(self) -> None:
        self.inner = hashlib.sha256()

    def update(self, data: memoryview) -> None:
        self.gate.wait(30)
        self.inner.update(data)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


def test_a_trainable_loaded_parameter_is_hashed_before_its_trainer_may_change_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hash reads the arrays the trainer was handed (no copy). A frozen one never
    # changes; one the optimizer updates in place must be hashed first, or the pin
    # would be of bytes the file never held.
    from sexpgpu.checkpoint import hashing
    from sexpgpu.session import Selection, Session, Target
    from tests.catalogs import project

    from .helpers import head_tensors, write_project

    sx = write_project(tmp_path)
    head = tmp_path / "head.safetensors"
    save_file(head_tensors(dtype="float32"), str(head))  # f32: the trainer gets the array read
    monkeypatch.setattr(hashing, "hashlib", SimpleNamespace(sha256=_HeldSha256))
    _HeldSha256.gate.clear()
    session = Session.start(project(), Selection(str(sx)), Target())
    trainer = session.lower("cpu")
    threading.Timer(0.5, _HeldSha256.gate.set).start()
    session.fill()
    with torch.no_grad():  # the optimizer's first update, in place
        trainer.params["model.head"].add_(1.0)
    pinned = session.loaded["model.head"]
    assert pinned["version"] == "sha256:" + hashlib.sha256(head.read_bytes()).hexdigest()
