"""A knob value of any size the run took, a float of 1e20 and a 30-digit integer, is
read back from its checkpoint by a resume in a new process and by `sexpgpu checkpoint`,
never refused as "not a value sexpgpu writes" (each command in a subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.helpers import events, experiments, run_sexpgpu, step_dirs

# A tiny model on generated arithmetic whose checkpoint interval is a knob: an integer
# of any length is a value it takes (past the last step, only the last one is written).
PROGRAM = """\
(defknob lr 0.5 "learning rate")
(defknob steps 4 "training steps")
(defknob every 2 "steps between checkpoints")

(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))

(defdata train (arithmetic :digits 3) :seq 32 :batch 16)

(defrun huge
  :model (net 32 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr lr)
  :steps steps
  :checkpoint-every every
  :seed 7)
"""

LONG = "123456789012345678901234567890"
RUN = ["run", "huge.sx", "--checkpoint-dir", "ckpt", "--metrics-dir", "m"]


def _knobs(step: Path) -> dict:
    record = json.loads((step / "experiment.json").read_text())
    return {knob["name"]: knob["value"] for knob in record["knobs"]}


def test_huge_knob_values_checkpoint_resume_and_are_described(tmp_path: Path) -> None:
    (tmp_path / "huge.sx").write_text(PROGRAM)
    first = run_sexpgpu(
        *RUN, "--set", "lr=1e20", "--set", f"every={LONG}", "--steps", "2", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002"]
    knobs = _knobs(tmp_path / "ckpt" / "step-00000002")
    assert knobs["lr"] == 1e20 and isinstance(knobs["lr"], float)
    assert knobs["every"] == int(LONG)

    described = run_sexpgpu("checkpoint", "ckpt/step-00000002", cwd=tmp_path)
    assert (described.returncode, described.stderr) == (0, ""), described.stderr
    lines = described.stdout.splitlines()
    knob_lines = lines[lines.index("knobs") + 1 : lines.index("choices")]
    assert [line.split() for line in knob_lines] == [
        ["lr", "1e+20", "command", "line"],
        ["steps", "2", "command", "line"],
        ["every", LONG, "command", "line"],
    ]

    # A new process resumes it with the same values, then again with others: each
    # reads the recorded values back, and the second records how they moved.
    same = run_sexpgpu(
        *RUN, "--set", "lr=1e20", "--set", f"every={LONG}", "--steps", "3", "--resume", "latest",
        cwd=tmp_path,
    )  # fmt: skip
    assert same.returncode == 0, same.stderr
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002", "step-00000003"]
    moved = run_sexpgpu(*RUN, "--resume", "ckpt/step-00000003", cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr
    assert step_dirs(tmp_path / "ckpt")[-1] == "step-00000004"
    (run_dir,) = experiments(tmp_path / "m")
    texts = [e["text"] for e in events(run_dir) if e["kind"] == "annotation"]
    resumed = [t.split("\n") for t in texts if t.startswith("resumed from")]
    assert resumed[-1] == [
        "resumed from ckpt/step-00000003",
        "knob lr 1e+20 -> 0.5",
        "knob steps 3 -> 4",
        f"knob every {LONG} -> 2",
    ]
    described = run_sexpgpu("checkpoint", "ckpt/step-00000003", cwd=tmp_path)
    assert (described.returncode, described.stderr) == (0, ""), described.stderr
    assert f"  every  {LONG}  command line" in described.stdout.splitlines()
