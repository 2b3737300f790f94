"""Shared pieces for the failure tests: small `.sx` files, the one-line check, a
throwaway data-source plugin, and the checks on a run that failed after it started."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.e2e.helpers import events, experiments, status
from tests.foundation.pluginkit import make_plugin

# Bytes as tokens through a two-matrix model. The knob `vocab` sizes the embedding
# table, so a table smaller than the 256 byte values makes `take` fail at run time.
TEXT_SX = """\
(defknob path "data.txt" "the text file")
(defknob vocab 256 "rows of the embedding table")
(defknob steps 4 "training steps")

(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))

(defdata train (text :path path) :seq 8 :batch 4)

(defrun textrun
  :model (net vocab 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01)
  :steps steps
  :checkpoint-every 2
  :seed 1)
"""

TOKENS_SX = """\
(defknob steps 4 "training steps")

(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))

(defdata train (tokens :path "train.bin" :dtype "uint16") :seq 8 :batch 4)

(defrun tokrun
  :model (net 64 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01)
  :steps steps
  :seed 1)
"""

NPY_SX = """\
(defknob steps 4 "training steps")

(defmodel linear (n classes)
  (param w [n classes] :init (normal 0.02))
  (forward (x) (matmul x w)))

(defdata train (npy :features "x.npy" :labels "y.npy") :batch 4)

(defrun npyrun
  :model (linear 5 3)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1)
  :steps steps
  :seed 1)
"""

# A run over the throwaway `flaky` data source below.
FLAKY_SX = """\
(defknob steps 6 "training steps")

(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))

(defdata train (flaky :vocab 16) :seq 8 :batch 4)

(defrun flakyrun
  :model (net 16 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01)
  :steps steps
  :checkpoint-every 2
  :seed 3)
"""

# A third-party data source whose loader raises a plain Python exception when it
# is asked for batch $FLAKY_FAIL_AT (1-based, so the batch of that step), or a
# sexpgpu RunError with FLAKY_KIND=sexp; without
# the variable it is a sound source of random tokens whose position restores.
FLAKY_PLUGIN = '''
"""A throwaway third-party data source that breaks at a chosen batch."""
import os

import numpy as np

from sexpgpu.errors import RunError
from sexpgpu.extension import DataSourceInfo
from sexpgpu.lang.ir import TensorType
from sexpgpu.hookspecs import hookimpl


class FlakyLoader:
    def __init__(self, options, seq, batch, seed):
        self.vocab, self.seq, self.batch, self.seed = options["vocab"], seq, batch, seed
        self.index = 0

    def next_batch(self):
        fail_at = int(os.environ.get("FLAKY_FAIL_AT", "0"))
        if fail_at and self.index + 1 == fail_at:
            if os.environ.get("FLAKY_KIND") == "sexp":
                # the way a careful plugin reports a user's problem: a SexpError
                raise RunError(f"flaky source lost its data at batch {fail_at}")
            raise ValueError(f"flaky source broke at batch {fail_at}")
        rng = np.random.default_rng([self.seed, self.index])
        rows = rng.integers(0, self.vocab, size=(self.batch, self.seq + 1), dtype=np.int64)
        self.index += 1
        return {"inputs": rows[:, :-1].copy(), "targets": rows[:, 1:].copy()}

    def position(self):
        return {"index": self.index}

    def restore(self, position):
        self.index = int(position["index"])


def _fields(options, seq, batch):
    return {"inputs": TensorType((batch, seq), "i64"), "targets": TensorType((batch, seq), "i64")}


@hookimpl
def sexpgpu_data_sources():
    return [DataSourceInfo(name="flaky", options={"vocab": 16}, fields=_fields,
                           factory=FlakyLoader, doc="random tokens that can break")]
'''


def flaky_plugin(root: Path) -> Path:
    """Install the `flaky` plugin into ``root/site`` as pip would; returns the folder
    to put on PYTHONPATH."""
    return make_plugin(
        root / "site",
        "flaky-source",
        {"flaky_source": FLAKY_PLUGIN},
        {"flaky-source": "flaky_source"},
    )


def _is_log_line(line: str) -> bool:
    # The tests run with SEXPGPU_LOG_FORMAT=json: every log line is a JSON object,
    # so whatever else is on stderr is what a user reads as the error.
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def error_line(result: subprocess.CompletedProcess, exit_code: int = 1) -> str:
    """The one line a failed command printed; asserts the exit code, that nothing else
    was printed, and that there is no traceback."""
    assert result.returncode == exit_code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line and not _is_log_line(line)]
    assert len(lines) == 1, result.stderr
    assert result.stdout.strip() == "", result.stdout
    return lines[0]


def assert_failed_run(metrics_dir: Path, line: str) -> Path:
    """A run that had started and failed: status `failed` with the error, and the
    last annotation `failed: <error>`. Returns the run's metrics folder."""
    (run_dir,) = experiments(metrics_dir)
    error = line.removeprefix("sexpgpu run: ")
    st = status(run_dir)
    assert st["state"] == "failed", st
    assert st["error"] == error, st
    stream = events(run_dir)
    at = max(i for i, e in enumerate(stream) if e["kind"] == "annotation")
    assert stream[at]["text"] == f"failed: {error}", stream[at]
    # A failed run ends its stream without `done` (an earlier launch's may be before).
    assert all(e["kind"] != "done" for e in stream[at:])
    return run_dir


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss point in a run's metrics stream."""
    return {e["step"]: e["value"] for e in events(run_dir) if e.get("name") == "loss"}


RESUME_RUN = ["run", "my-run.sx", "--checkpoint-dir", "ckpt", "--metrics-dir", "m", "--steps", "6"]
"""The run a damaged checkpoint is resumed by (6 steps, past the 4 of the trained one)."""
