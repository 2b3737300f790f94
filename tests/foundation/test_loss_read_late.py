"""The run loop with a trainer that sets ``reads_loss_late``: each step's loss is
read once the next step is proposed, and before anything else is said of its step."""

from __future__ import annotations

import json

from .pluginkit import run_python

PROGRAM = """
(defmodel mlp (vocab dim)
  (layer embed (embedding vocab dim))
  (layer head (linear dim vocab))
  (forward (ids) (-> ids embed head)))
(defdata train (sort :vocab 8) :seq 4 :batch 4)
(defrun late
  :model (mlp 8 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1)
  :steps 7
  :checkpoint-every 3
  :seed 1
  :evals ((eval probe :every 3 :data train :batches 1 :metrics (loss))))
"""

SCRIPT = """
import json
import sexpgpu.session as session
from sexpgpu.catalog import Catalog
from sexpgpu.session import Selection
from sexpgpu.train import RunOptions, run

seen = []


class Read:
    def __init__(self, inner, step):
        self.inner, self.step = inner, step

    @property
    def loss(self):
        seen.append(("loss", self.step))
        return self.inner.loss


class Late:
    reads_loss_late = True

    def __init__(self, trainer):
        self.__dict__["inner"] = trainer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, batch, *, stage, step, lr):
        seen.append(("propose", step))
        return Read(self.inner.propose(batch, stage=stage, step=step, lr=lr), step)

    def commit(self, proposal):
        self.inner.commit(proposal.inner)


lower = session.lower


def late_lower(*args, **kwargs):
    lowered = lower(*args, **kwargs)
    lowered.trainer = Late(lowered.trainer)
    return lowered


session.lower = late_lower
options = RunOptions(
    Selection("late.sx"), metrics_dir="m", metrics_sinks=("jsonl",), checkpoint_dir="ck"
)
outcome = run(options, Catalog.load())
print(json.dumps({"code": outcome.exit_code, "seen": seen}))
"""


def test_each_loss_is_read_after_the_next_step_is_proposed_or_before_its_step_is_reported(
    tmp_path,
):
    (tmp_path / "late.sx").write_text(PROGRAM)
    result = run_python(SCRIPT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["code"] == 0
    # steps 3 and 6 have a pass and a checkpoint: their losses are read at once;
    # step 7 is the last
    assert [tuple(item) for item in report["seen"]] == [
        ("propose", 1),
        ("propose", 2),
        ("loss", 1),
        ("propose", 3),
        ("loss", 2),
        ("loss", 3),
        ("propose", 4),
        ("propose", 5),
        ("loss", 4),
        ("propose", 6),
        ("loss", 5),
        ("loss", 6),
        ("propose", 7),
        ("loss", 7),
    ]
    lines = (next((tmp_path / "m").iterdir()) / "events.jsonl").read_text().splitlines()
    losses = [e["step"] for e in map(json.loads, lines) if e.get("name") == "loss"]
    assert losses == [1, 2, 3, 4, 5, 6, 7]
