"""`npy`'s `:holdout` and `:split`: one pair of .npy files, a train and a val split."""

from __future__ import annotations

import math

import numpy as np
import pytest

import sexpgpu_data
from sexpgpu.errors import SexpError
from tests.e2e.helpers import run_sexpgpu, sexpgpu_in_process

NPY = {info.name: info for info in sexpgpu_data.data_sources()}["npy"]
COUNT = 20


@pytest.fixture
def files(tmp_path):
    """20 records whose first feature is 3 * the record number (so a batch names its records)."""
    x = np.arange(COUNT * 3, dtype=np.float32).reshape(COUNT, 3)
    y = (np.arange(COUNT) * 7 % 5).astype(np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return {"features": str(tmp_path / "x.npy"), "labels": str(tmp_path / "y.npy")}


def records(batch: dict[str, np.ndarray]) -> list[int]:
    return (batch["inputs"][:, 0] / 3).astype(int).tolist()


def epoch(options, seed: int, batch: int = 1) -> list[int]:
    """The records of one epoch, in their order."""
    loader = NPY.factory(options, 0, batch, seed)
    return [r for _ in range(loader.batches_per_epoch) for r in records(loader.next_batch())]


def same(a, b):
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a
    )


def test_train_and_val_are_disjoint_and_cover_every_record(files):
    train = epoch({**files, "holdout": 0.25, "split": "train"}, 3)
    val = epoch({**files, "holdout": 0.25, "split": "val"}, 3)
    assert len(val) == 5 and len(train) == 15  # round(0.25 * 20)
    assert not set(train) & set(val)
    assert sorted(train + val) == list(range(COUNT))
    # the default split is "train"
    assert sorted(epoch({**files, "holdout": 0.25}, 3)) == sorted(train)
    # labels come with their records
    b = NPY.factory({**files, "holdout": 0.25, "split": "val"}, 0, 5, 3).next_batch()
    assert b["targets"].tolist() == [r * 7 % 5 for r in records(b)]


def test_the_partition_does_not_depend_on_the_seed(files):
    for split in ("train", "val"):
        opts = {**files, "holdout": 0.3, "split": split}
        one, two = epoch(opts, 1), epoch(opts, 2)
        assert sorted(one) == sorted(two)
        assert one != two  # each seed still shuffles the split its own way
    # an eval pass opens its data with seed + 1: still none of the training records
    train = epoch({**files, "holdout": 0.3, "split": "train"}, 5)
    assert not set(train) & set(epoch({**files, "holdout": 0.3, "split": "val"}, 6))


def test_a_larger_holdout_sets_aside_more_records(files):
    for h in (0.05, 0.1, 0.5, 0.95):
        val = epoch({**files, "holdout": h, "split": "val"}, 0)
        assert len(val) == round(h * COUNT)
    small = set(epoch({**files, "holdout": 0.1, "split": "val"}, 0))
    assert small <= set(epoch({**files, "holdout": 0.5, "split": "val"}, 0))


def test_without_holdout_the_batches_are_as_before(files):
    plain = NPY.factory(files, 0, 4, 7)
    explicit = NPY.factory({**files, "holdout": 0.0, "split": "train"}, 0, 4, 7)
    integer = NPY.factory({**files, "holdout": 0}, 0, 4, 7)
    got = []
    for _ in range(11):  # two epochs and a bit
        b = plain.next_batch()
        assert same(b, explicit.next_batch()) and same(b, integer.next_batch())
        got.append(records(b))
    # pinned: the order the source gave before :holdout existed (resumed runs rely on it)
    assert got[:6] == [
        [5, 14, 16, 15],
        [18, 7, 8, 19],
        [6, 0, 12, 17],
        [10, 9, 2, 3],
        [11, 4, 13, 1],
        [7, 11, 16, 5],
    ]


def test_each_split_is_reshuffled_every_epoch(files):
    loader = NPY.factory({**files, "holdout": 0.25, "split": "train"}, 0, 5, 4)
    assert loader.batches_per_epoch == 3
    epochs = [sum((records(loader.next_batch()) for _ in range(3)), []) for _ in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_restore_continues_on_a_split(files, split, k):
    opts = {**files, "holdout": 0.4, "split": split}  # val 8 records, train 12; batch 3
    loader = NPY.factory(opts, 0, 3, 9)
    for _ in range(k):
        loader.next_batch()
    saved = loader.position()
    assert set(saved) == {"epoch", "index"}
    expected = [loader.next_batch() for _ in range(9)]  # crosses epoch boundaries
    fresh = NPY.factory(opts, 0, 3, 9)
    fresh.restore(saved)
    got = [fresh.next_batch() for _ in range(9)]
    assert all(same(a, b) for a, b in zip(expected, got, strict=True))
    assert fresh.position() == loader.position()
    with pytest.raises(SexpError) as e:
        fresh.restore({"epoch": 0, "index": loader.batches_per_epoch + 1})
    assert e.value.code == "E-DATA-006"


def test_fields_describe_a_split_batch(files):
    opts = {**files, "holdout": 0.25, "split": "val"}
    fields = NPY.fields(opts, 0, 5)
    b = NPY.factory(opts, 0, 5, 0).next_batch()
    assert {k: (t.shape, t.dtype) for k, t in fields.items()} == {
        "inputs": ((5, 3), "f32"),
        "targets": ((5,), "i64"),
    }
    assert b["inputs"].shape == (5, 3) and b["targets"].shape == (5,)


def test_val_without_holdout_is_refused(files):
    for call in (
        lambda o: NPY.fields(o, 0, 2),
        lambda o: NPY.factory(o, 0, 2, 0),
    ):
        for opts in ({**files, "split": "val"}, {**files, "split": "val", "holdout": 0.0}):
            with pytest.raises(SexpError) as e:
                call(opts)
            assert e.value.code == "E-DATA-005"
            assert ':split "val" takes the records :holdout sets aside' in str(e.value)
            assert "give :holdout, e.g. 0.1" in str(e.value)
            assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"split": "eval"}, "option :split must be one of 'train', 'val', got 'eval'"),
        ({"split": "test", "holdout": 0.2}, "must be one of 'train', 'val', got 'test'"),
        ({"split": ""}, "option :split must be one of 'train', 'val', got ''"),
        ({"split": 1}, "option :split must be one of"),
        ({"holdout": 1.0}, "option :holdout must be at least 0 and below 1, got 1.0"),
        ({"holdout": 1}, "option :holdout must be at least 0 and below 1, got 1.0"),
        ({"holdout": -0.1}, "option :holdout must be at least 0 and below 1, got -0.1"),
        ({"holdout": 2.5}, "must be at least 0 and below 1, got 2.5"),
        ({"holdout": math.nan}, "must be at least 0 and below 1, got nan"),
        ({"holdout": "0.1"}, "option :holdout must be a number, got '0.1'"),
        ({"holdout": True}, "option :holdout must be a number, got True"),
    ],
)
def test_bad_split_or_holdout_is_refused(files, change, message):
    for call in (lambda o: NPY.fields(o, 0, 2), lambda o: NPY.factory(o, 0, 2, 0)):
        with pytest.raises(SexpError) as e:
            call({**files, **change})
        assert e.value.code == "E-DATA-005", change
        assert message in str(e.value), change


@pytest.mark.parametrize("holdout,split,n", [(0.1, "val", 2), (0.9, "train", 2), (0.01, "val", 0)])
def test_a_split_smaller_than_a_batch_is_refused(files, holdout, split, n):
    opts = {**files, "holdout": holdout, "split": split}
    for call in (lambda o: NPY.fields(o, 0, 4), lambda o: NPY.factory(o, 0, 4, 0)):
        with pytest.raises(SexpError) as e:
            call(opts)
        assert e.value.code == "E-DATA-002"
        assert f":split '{split}'" in str(e.value)
        assert f"has {n} of its 20 records" in str(e.value)
        assert "too few for one batch of 4" in str(e.value)
    # the other split of the same files has enough records for a batch
    other = "train" if split == "val" else "val"
    assert len(NPY.factory({**opts, "split": other}, 0, 1, 0).next_batch()["inputs"]) == 1


def test_the_descriptor_documents_both_options():
    assert NPY.options["holdout"] == 0.0 and NPY.options["split"] == "train"
    assert "val" in NPY.option_docs["split"] and "seed" in NPY.option_docs["holdout"]


RUN = """
(defdata train (npy :features "x.npy" :labels "y.npy" :holdout 0.25) :batch 4)
(defdata val (npy :features "x.npy" :labels "y.npy" :holdout 0.25 :split "val") :batch 5)
(defmodel net () (param w [3 5] :init (normal 0.02)) (forward (x) (matmul x w)))
(defrun r :model (net) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr 0.1) :steps 2
  :evals ((eval held :every 1 :data val :batches 1 :metrics (loss accuracy))))
"""


def test_sexpgpu_check_takes_an_eval_pass_on_the_val_split(files, tmp_path):
    (tmp_path / "run.sx").write_text(RUN)
    r = run_sexpgpu("check", "run.sx", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # the same program with :split "val" but no :holdout is refused at the defdata
    (tmp_path / "bad.sx").write_text(RUN.replace(':holdout 0.25 :split "val"', ':split "val"'))
    r = sexpgpu_in_process("check", "bad.sx", cwd=tmp_path)
    assert r.returncode != 0
    assert "E-DATA-005" in r.stderr and "give :holdout, e.g. 0.1" in r.stderr
    assert "bad.sx:3:" in r.stderr
