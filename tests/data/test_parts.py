"""Each rank of several builds only its rows of a global batch (``next_part``), and a
source that cannot is cut by the run loop; either way the parts, in rank order, are
the whole batch, and the stream moves as it does for one rank."""

from __future__ import annotations

import numpy as np
import pytest

import sexpgpu_data
from sexpgpu.errors import SexpError
from tests.catalogs import compile_text

SOURCES = {info.name: info for info in sexpgpu_data.data_sources()}


def _opened(tmp_path, source: str):
    """A loader of ``source`` with batches of 6 rows, and a second one like it."""
    if source == "text":
        path = tmp_path / "corpus.txt"
        path.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 400, dtype=np.uint8)))
        options, seq = {"path": str(path)}, 8
    elif source == "npy":
        x, y = tmp_path / "x.npy", tmp_path / "y.npy"
        np.save(x, np.random.default_rng(1).normal(size=(40, 3)).astype(np.float32))
        np.save(y, np.random.default_rng(2).integers(0, 4, size=40))
        options, seq = {"features": str(x), "labels": str(y)}, 0
    else:
        options, seq = {"vocab": 8}, 6
    info = SOURCES[source]
    full = {**info.options, **options}
    return (info.factory(full, seq, 6, 5), info.factory(full, seq, 6, 5))


@pytest.mark.parametrize("source", ["text", "npy", "sort"])
@pytest.mark.parametrize("size", [2, 3])
def test_the_ranks_parts_are_the_whole_batch_in_rank_order(tmp_path, source, size):
    whole, _ = _opened(tmp_path, source)
    ranks = [_opened(tmp_path, source)[0] for _ in range(size)]
    for _ in range(9):  # past the end of an epoch of the file sources
        batch = whole.next_batch()
        parts = [loader.next_part(r, size) for r, loader in enumerate(ranks)]
        for name, rows in batch.items():
            assert len(parts[0][name]) == len(rows) // size
            joined = np.concatenate([part[name] for part in parts])
            assert joined.dtype == rows.dtype and joined.tobytes() == rows.tobytes(), name
        assert all(loader.position() == whole.position() for loader in ranks)


def test_a_file_source_reads_only_its_rows(tmp_path):
    loader, _ = _opened(tmp_path, "npy")
    assert hasattr(loader, "next_part")  # the file sources build their part alone
    taken = []
    real = loader._take
    loader._take = lambda picked: taken.append(len(picked)) or real(picked)
    loader.next_part(1, 3)
    assert taken == [2]


def test_one_rank_takes_the_whole_batch(tmp_path):
    loader, twin = _opened(tmp_path, "sort")
    batch = loader.next_part(0, 1)
    assert all(batch[k].tobytes() == v.tobytes() for k, v in twin.next_batch().items())


def test_counting_tokens_of_a_source_without_them_is_one_positioned_line():
    source = """(defmodel cnn (classes)
  (layer head (linear 64 classes))
  (forward (images) (-> images flatten head)))
(defdata pics (shapes :classes 4 :size 8) :batch 4)
(defrun r :model (cnn 4) :data pics :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01) :steps 2 :counters (records tokens))
"""
    with pytest.raises(SexpError) as caught:
        compile_text(source, "counts.sx")
    assert caught.value.render() == (
        "counts.sx:4:10: the data source 'shapes' has no token field, so the counter "
        "'tokens' cannot be kept; count records instead"
    )
