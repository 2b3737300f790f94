"""`sexpgpu evaluate` never opens the training loader (spec: "What evaluate reads"): an
evaluator holds the checkpoints and its passes' data, not the training set.

The run here reads its training file in both stages, once as batches and once as a
generator's prompts, and its two passes read other data: a file of their own, and
prompts a data source makes. With the training file gone, evaluating one checkpoint
and following the run both give the run's own numbers, bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.e2e.helpers import run_sexpgpu

from .kit import eval_points

PROGRAM = """
(defmodel gpt (vocab seq dim)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (layer block (transformer-block dim 2))
  (layer head (linear dim vocab))
  (forward (ids) (head (block (+ (embed ids) pos)))))

(defdata train (text :path "train.txt") :seq 8 :batch 4)
(defdata held (text :path "held.txt") :seq 8 :batch 4)
(defdata prompts (sort :vocab 8 :length 3 :split "rl") :seq 8 :batch 4)

(defrun unread
  :model (gpt 256 8 16)
  :optimizer (adam :lr 0.01)
  :seed 3
  :checkpoint-every 2
  :stages ((stage imitate :steps 2 :data train :loss (cross-entropy (model inputs) targets))
           (stage sample :steps 2 :data train
            :generate (sample model :new-tokens 3 :prompt 4 :reward (sum completion-mask :axis 1))
            :loss (neg (mean (* reward (sum (* (gather (log-softmax (model sequence)) next)
                                               next-mask) :axis 1))))))
  :evals ((eval held :every 2 :data held
           :metrics ((ce (cross-entropy (model inputs) targets))))
          (eval sampled :every 2 :data prompts
           :generate (sample model :new-tokens 4 :temperature 1.0)
           :metrics (reward generated-length))))
"""


def _project(root: Path) -> Path:
    rng = random.Random(5)
    for name in ("train.txt", "held.txt"):
        (root / name).write_text("".join(rng.choice("abcdefgh \n") for _ in range(2048)))
    (root / "unread.sx").write_text(PROGRAM)
    return root


def test_evaluate_and_follow_read_no_training_data(tmp_path):
    workdir = _project(tmp_path)
    ran = run_sexpgpu(
        "run", "unread.sx", "--checkpoint-dir", "ck", "--metrics-dir", "m", cwd=workdir
    )
    assert ran.returncode == 0, ran.stderr
    in_run = eval_points(workdir, source=None)
    assert sorted({step for step, _ in in_run}) == [2, 4]

    (workdir / "train.txt").unlink()
    one = run_sexpgpu("evaluate", "ck/step-00000002", "--metrics-dir", "m", cwd=workdir)
    assert one.returncode == 0, one.stderr
    followed = run_sexpgpu(
        "evaluate", "ck", "--follow", "--poll", "0.1", "--metrics-dir", "m", cwd=workdir
    )
    assert followed.returncode == 0, followed.stderr
    assert "train.txt" not in one.stderr + followed.stderr
    evaluated = eval_points(workdir, source="evaluate")
    assert sorted(evaluated) == sorted(in_run)
    for (step, name), values in evaluated.items():
        want = in_run[(step, name)] * (2 if step == 2 else 1)  # step 2: once, then followed
        assert values == want, (step, name)
