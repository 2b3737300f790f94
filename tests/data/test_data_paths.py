"""A data file named in a `.sx` file is found relative to that file, as `include` and
`:load` are, whatever folder `sexpgpu` runs in (docs/data.md, "Paths")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests import inprocess

SEXPGPU = str(Path(sys.executable).with_name("sexpgpu"))

MODEL = """(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
"""
RUN = """(defrun r :model (net 256 8) :data train
  :loss (cross-entropy (model inputs) targets) :optimizer (sgd :lr 0.1) :steps 1 :seed 1)
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SEXPGPU_")}


def sexpgpu(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SEXPGPU, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120
    )


def in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command that trains nothing (`check`), in this process: tests/inprocess.py."""
    return inprocess.sexpgpu(*args, cwd=cwd, env=_env())


def test_a_relative_path_is_relative_to_the_sx_file_not_the_working_folder(tmp_path) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "corpus.txt").write_text("hello, relative paths " * 20)
    (project / "run.sx").write_text(
        MODEL + '(defdata train (text :path "data/corpus.txt") :seq 8 :batch 2)\n' + RUN
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = in_process("check", "../project/run.sx", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    r = sexpgpu("run", str(project / "run.sx"), cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    (status,) = elsewhere.glob("sexpgpu-runs/*/status.json")
    assert json.loads(status.read_text())["step"] == 1
    # a file of that name in the working folder is not the one read
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "corpus.txt").write_text("x")
    assert in_process("check", "../project/run.sx", cwd=elsewhere).returncode == 0


def test_paths_in_an_included_file_are_relative_to_it(tmp_path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    np.save(lib / "x.npy", np.arange(24, dtype=np.float32).reshape(6, 4))
    np.save(lib / "y.npy", np.arange(6, dtype=np.int64) % 2)
    (lib / "data.sx").write_text(
        '(defdata train (npy :features "x.npy" :labels "y.npy") :batch 2)\n'
    )
    (tmp_path / "run.sx").write_text(
        '(include "lib/data.sx")\n'
        "(defmodel net () (param w [4 2] :init (normal 0.02)) (forward (x) (matmul x w)))\n"
        "(defrun r :model (net) :data train :loss (cross-entropy (model inputs) targets)\n"
        "  :optimizer (sgd :lr 0.1) :steps 1)\n"
    )
    r = in_process("check", "run.sx", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_a_missing_file_is_named_where_it_was_looked_for(tmp_path) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "run.sx").write_text(
        MODEL + '(defdata train (tokens :path "train.bin") :seq 8 :batch 2)\n' + RUN
    )
    r = in_process("check", "sub/run.sx", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("sub/run.sx:5:"), r.stderr
    assert "no such file 'sub/train.bin'" in r.stderr


def test_an_absolute_path_is_kept_as_written(tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("absolute " * 30)
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "run.sx").write_text(
        MODEL + f"(defdata train (text :path {json.dumps(str(corpus))}) :seq 8 :batch 2)\n" + RUN
    )
    assert in_process("check", "sub/run.sx", cwd=tmp_path).returncode == 0
