"""Helpers for the :load tests: safetensors files made with the safetensors library
(never with sexpgpu's own writer), `.sx` programs that read them, and `sexpgpu` runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.e2e.helpers import run_sexpgpu, sexpgpu_env

__all__ = ["run_sexpgpu", "sexpgpu_env"]

# A model whose head trains from a file and a teacher root read whole from another:
# the two kinds of :load parameter a checkpoint keeps apart.
PROGRAM = """\
(defknob steps 4 "training steps")
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02) :load (file "{head_uri}" "lm_head.weight"))
  (forward (tokens) (matmul (take embed tokens) head)))
(deflayer tnet (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 32 :batch 16)
(defrun loads
  :model (net 32 8)
  :with-loaded (teacher (tnet 32 8) :file "{teacher_uri}" :names "{names}")
  :data train
  :loss (+ (cross-entropy (model inputs) targets) (mse (model inputs) (teacher inputs)))
  :optimizer (adam :lr 0.01)
  :steps steps
  :checkpoint-every 1
  :seed 7)
"""


def teacher_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors of a teacher file, named as a sexpgpu checkpoint names them."""
    rng = np.random.default_rng(seed)
    return {
        "teacher.embed.weight": rng.normal(size=(32, 8)).astype(np.float32),
        "teacher.head.weight": rng.normal(size=(8, 32)).astype(np.float32),
    }


def head_tensors(seed: int = 1, dtype: str = "float16") -> dict[str, np.ndarray]:
    """The file the trainable head starts from, with a tensor the program does not use."""
    rng = np.random.default_rng(seed)
    return {
        "lm_head.weight": rng.normal(size=(8, 32)).astype(dtype),
        "unused.weight": rng.normal(size=(64, 64)).astype(np.float32),
    }


def write_project(
    folder: Path,
    *,
    head_uri: str = "head.safetensors",
    teacher_uri: str = "teacher.safetensors",
    names: str = "{path}.weight",
    files: bool = True,
) -> Path:
    """``loads.sx`` in ``folder``, with its two files when ``files``; returns the program."""
    if files:
        save_file(teacher_tensors(), str(folder / "teacher.safetensors"))
        save_file(head_tensors(), str(folder / "head.safetensors"))
    sx = folder / "loads.sx"
    sx.write_text(PROGRAM.format(head_uri=head_uri, teacher_uri=teacher_uri, names=names))
    return sx


def experiment(step_dir: Path) -> dict:
    """A checkpoint's experiment.json."""
    return json.loads((step_dir / "experiment.json").read_text())


def said(stderr: str) -> list[str]:
    """What `sexpgpu` told the user: stderr less its JSON log records."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]
