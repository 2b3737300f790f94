"""A run whose second stage changes data source, batch shape and optimizer resumes to
the bit from every checkpoint, at torch's default thread count and at two threads on
a lower ATen capability, each started as a user would with nothing pinned.

Issue 49's reproduction: on an AMD EPYC at the default count, every resume
differed from the first step of stage two on (MKL's mode: test_mkl_mode.py), while
the suite's ``OMP_NUM_THREADS=1`` hid it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.e2e.helpers import run_sexpgpu, sexpgpu_env
from tests.profiles import profile_env

PROGRAM = """\
(defknob steps 4)
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (param noise [vocab] :init (uniform -1 1) :frozen true)
  (forward (tokens) (+ (matmul (dropout (take embed tokens) 0.3) head) noise)))
(defdata a (tokens :path "t.bin" :dtype "uint16") :seq 8 :batch 2)
(defdata b (arithmetic :digits 2) :seq 10 :batch 4)
(defrun x :model (net 16 8) :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.05 :schedule (cosine :warmup 2 :min-lr 0.001))
  :stages ((stage one :steps 7 :data a) (stage two :steps 5 :data b :optimizer (sgd :lr 0.1 :momentum 0.9)))
  :checkpoint-every 1 :seed 11 :counters (tokens records))
"""
STEPS = 12
FILES = ("params.safetensors", "states.safetensors")
RESUMED_FROM = {
    # every checkpoint where the issue asks it; the stage boundary on either side elsewhere
    "default-threads": range(1, STEPS),
    "two-threads-lower-isa": (1, 7, 8, 10),
}


@pytest.mark.parametrize("profile", sorted(RESUMED_FROM))
def test_a_run_that_changes_stage_resumes_to_the_bit_from_its_checkpoints(
    profile: str, tmp_path: Path
) -> None:
    (tmp_path / "x.sx").write_text(PROGRAM)
    (np.arange(261, dtype=np.uint16) % 16).astype(np.uint16).tofile(tmp_path / "t.bin")
    env = profile_env(profile, sexpgpu_env())
    straight = run_sexpgpu("run", "x.sx", "--checkpoint-dir", "ref", cwd=tmp_path, env=env)
    assert straight.returncode == 0, straight.stderr
    differences = []
    for step in RESUMED_FROM[profile]:
        resumed = run_sexpgpu("run", "x.sx", "--resume", f"ref/step-{step:08d}",
                              "--checkpoint-dir", f"r{step}", cwd=tmp_path, env=env)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        for later in range(step + 1, STEPS + 1):
            for file in FILES:
                path = f"step-{later:08d}/{file}"
                if (tmp_path / f"r{step}" / path).read_bytes() != (
                    tmp_path / "ref" / path
                ).read_bytes():
                    differences.append(f"resumed from step {step}: {path} differs")
    assert not differences, "\n".join(differences)
