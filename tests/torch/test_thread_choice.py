"""How many threads a new run takes (sexpgpu_torch.threads): its step's work from the
shapes the compiler inferred, and the cores it may use, a cgroup's quota included."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sexpgpu_torch import threads
from tests.catalogs import compile_text

MATMUL = """
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (sort :vocab 16) :seq 8 :batch 4)
(defrun r :model (net 16 {dim}) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1) :steps 2)
"""


def _work_by_hand(dim: int) -> float:
    rows, vocab = 4 * 8, 16
    matmul = rows * vocab * dim  # [rows, dim] x [dim, vocab]
    return matmul


def test_a_matmul_counts_its_multiply_adds_and_training_three_times_its_forward() -> None:
    small, wide = (compile_text(MATMUL.format(dim=d), "m.sx") for d in (8, 64))
    # the products dominate: the rest adds one per value made
    for program, dim in ((small, 8), (wide, 64)):
        loss = program.stages[0].loss
        forward = threads.graph_work(loss)
        values = sum(math.prod(n.type.shape) for n in loss.nodes if n.op != "matmul")
        assert forward == _work_by_hand(dim) + values
        assert threads.step_work(program) == 3 * forward
    assert threads.step_work(wide) > 6 * threads.step_work(small)


def test_a_repeat_counts_each_iteration_and_attention_its_scores() -> None:
    def work(layers: int, seq: int) -> float:
        text = f"""
(defmodel gpt (vocab seq dim heads layers)
  (layer embed (embedding vocab dim))
  (layer blocks (repeat layers (transformer-block dim heads)))
  (layer head (linear dim vocab))
  (forward (ids) (-> (embed ids) blocks head)))
(defdata train (sort :vocab 16) :seq {seq} :batch 4)
(defrun r :model (gpt 16 {seq} 32 4 {layers}) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1) :steps 2)
"""
        return threads.step_work(compile_text(text, "g.sx"))

    one, two = work(1, 16), work(2, 16)
    block = two - one
    assert block > 0 and abs(work(3, 16) - one - 2 * block) < 1e-6 * block
    # doubling the positions doubles the linear layers' work and quadruples attention's
    assert work(2, 32) - 2 * two > 0


@pytest.mark.parametrize(
    ("work", "cores", "chosen"),
    [(0, 8, 1), (threads.WORK_PER_THREAD * 0.9, 8, 1), (threads.WORK_PER_THREAD * 2.5, 8, 2),
     (threads.WORK_PER_THREAD * 100, 8, 8), (threads.WORK_PER_THREAD * 100, 1, 1)],
)  # fmt: skip
def test_one_thread_per_share_of_work_at_most_the_cores(work, cores, chosen) -> None:
    assert threads._chosen(work, cores) == chosen


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: the second one partly
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "garbage"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_a_cgroup_quota_is_read_from_v2_or_v1(tmp_path: Path, files, quota) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert threads.cgroup_quota(tmp_path) == quota


def test_the_usable_cores_are_the_affinity_capped_by_the_quota(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert threads.usable_cores(tmp_path) == 4
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert threads.usable_cores(tmp_path) == 1
