"""The file data sources: text, tokens, npy."""

from __future__ import annotations

import numpy as np
import pytest

import sexpgpu_data
from sexpgpu.errors import SexpError

SOURCES = {info.name: info for info in sexpgpu_data.data_sources()}
DTYPES = {"i64": np.int64, "f32": np.float32}


def same(a, b):
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a
    )


def check_fields(name, options, seq, batch, loader):
    fields = SOURCES[name].fields(options, seq, batch)
    b = loader.next_batch()
    assert set(b) == set(fields)
    for key, ttype in fields.items():
        assert b[key].shape == ttype.shape, key
        assert b[key].dtype == DTYPES[ttype.dtype], key
    return b


@pytest.fixture
def text_file(tmp_path):
    # 7 windows of seq 8 (57 bytes needed, 60 given): 3 batches of 2 per epoch.
    path = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    path.write_bytes(bytes(rng.integers(0, 256, size=60, dtype=np.uint8)))
    return path


@pytest.fixture
def token_files(tmp_path):
    rng = np.random.default_rng(1)
    files = {}
    for dtype, high in (("uint16", 65535), ("uint32", 2**32 - 1)):
        path = tmp_path / f"train-{dtype}.bin"
        data = rng.integers(0, high, size=100, dtype=np.int64).astype(dtype)
        data[0] = high  # the largest id must come through unchanged
        data.tofile(path)
        files[dtype] = (path, data)
    return files


@pytest.fixture
def npy_files(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 3, 4)).astype(np.float64)
    y = rng.integers(0, 5, size=10).astype(np.int32)
    y_reg = rng.normal(size=(10, 2)).astype(np.float32)
    paths = {}
    for key, arr in (("x", x), ("y", y), ("y_reg", y_reg)):
        paths[key] = tmp_path / f"{key}.npy"
        np.save(paths[key], arr)
    return paths, x, y, y_reg


def test_text_windows_are_the_file_bytes_and_targets_the_next_byte(text_file):
    data = text_file.read_bytes()
    opts = {"path": str(text_file)}
    loader = SOURCES["text"].factory(opts, 8, 2, 0)
    seen = []
    for _ in range(3):
        b = check_fields("text", opts, 8, 2, loader)
        for x, t in zip(b["inputs"], b["targets"], strict=True):
            start = data.find(bytes(x.astype(np.uint8)))
            assert start % 8 == 0
            assert bytes(t.astype(np.uint8)) == data[start + 1 : start + 9]
            seen.append(start)
    # One epoch: 3 batches of 2 distinct windows out of 7.
    assert len(set(seen)) == 6
    assert loader.position() == {"epoch": 1, "index": 0}


def test_tokens_files_of_both_dtypes(token_files):
    for dtype, (path, data) in token_files.items():
        opts = {"path": str(path), "dtype": dtype}
        loader = SOURCES["tokens"].factory(opts, 9, 4, 3)
        starts = []
        for _ in range(2):
            b = check_fields("tokens", opts, 9, 4, loader)
            for x, t in zip(b["inputs"], b["targets"], strict=True):
                (hits,) = np.nonzero(data[: len(data) - 9 : 9] == x[0])
                start = next(h * 9 for h in hits if (data[h * 9 : h * 9 + 9] == x).all())
                assert (data[start + 1 : start + 10] == t).all()
                starts.append(start)
        assert len(set(starts)) == 8
        all_ids = np.concatenate(
            [SOURCES["tokens"].factory(opts, 9, 11, 0).next_batch()["inputs"].ravel()]
        )
        assert all_ids.max() == data.max()  # no wrap-around of large ids


def test_epochs_are_reshuffled(text_file):
    opts = {"path": str(text_file)}
    loader = SOURCES["text"].factory(opts, 8, 1, 0)
    epochs = [
        [bytes(loader.next_batch()["inputs"][0].astype(np.uint8)) for _ in range(7)]
        for _ in range(3)
    ]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("source", ["text", "tokens", "npy"])
def test_restore_continues_byte_for_byte_across_epochs(
    source, k, text_file, token_files, npy_files
):
    if source == "text":
        opts, seq, batch = {"path": str(text_file)}, 8, 2
    elif source == "tokens":
        opts, seq, batch = {"path": str(token_files["uint16"][0])}, 9, 3
    else:
        paths = npy_files[0]
        opts, seq, batch = {"features": str(paths["x"]), "labels": str(paths["y"])}, 1, 3
    loader = SOURCES[source].factory(opts, seq, batch, 9)
    for _ in range(k):
        loader.next_batch()
    saved = loader.position()
    assert set(saved) == {"epoch", "index"}
    expected = [loader.next_batch() for _ in range(8)]  # crosses at least two epoch boundaries
    fresh = SOURCES[source].factory(opts, seq, batch, 9)
    fresh.restore(saved)
    got = [fresh.next_batch() for _ in range(8)]
    assert all(same(a, b) for a, b in zip(expected, got, strict=True))
    assert fresh.position() == loader.position()


def test_another_seed_gives_another_order(text_file):
    opts = {"path": str(text_file)}
    a = [SOURCES["text"].factory(opts, 8, 2, s).next_batch() for s in (1, 1, 2)]
    assert same(a[0], a[1]) and not same(a[0], a[2])


def test_a_position_past_the_end_of_an_epoch_is_refused(text_file):
    loader = SOURCES["text"].factory({"path": str(text_file)}, 8, 2, 0)
    loader.restore({"epoch": 2, "index": 3})  # == batches per epoch: the next epoch's start
    assert loader.position() == {"epoch": 3, "index": 0}
    with pytest.raises(SexpError) as e:
        loader.restore({"epoch": 0, "index": 4})
    assert e.value.code == "E-DATA-006" and "has 3 batches" in str(e.value)


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_missing_and_short_files(source, tmp_path):
    missing = {"path": str(tmp_path / "nope.bin")}
    for call in (
        lambda o: SOURCES[source].check(o, 8, 2),
        lambda o: SOURCES[source].factory(o, 8, 2, 0),
    ):
        with pytest.raises(SexpError) as e:
            call(missing)
        assert e.value.code == "E-DATA-001" and "no such file" in str(e.value)
        short = tmp_path / "short.bin"
        short.write_bytes(b"\0" * (16 * (2 if source == "tokens" else 1)))  # 16 items
        with pytest.raises(SexpError) as e:
            call({"path": str(short)})
        assert e.value.code == "E-DATA-002"
        assert "too short for one batch of 2 windows of 8+1 (needs at least 17)" in str(e.value)
        with pytest.raises(SexpError) as e:
            call({"path": str(tmp_path)})
        assert e.value.code == "E-DATA-001" and "is not a file" in str(e.value)


def test_exactly_long_enough_file_works(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"abcdefghijklmnopq")  # 17 bytes: 2 windows of 8+1
    b = SOURCES["text"].factory({"path": str(path)}, 8, 2, 0).next_batch()
    assert sorted(bytes(r.astype(np.uint8)) for r in b["inputs"]) == [b"abcdefgh", b"ijklmnop"]


def test_token_option_errors(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 41)
    with pytest.raises(SexpError, match="not a whole number of uint16 tokens") as e:
        SOURCES["tokens"].check({"path": str(odd)}, 8, 2)
    assert e.value.code == "E-DATA-002"
    # the types need no file: an evaluator may have none of the training data
    absent = {"path": str(tmp_path / "absent.bin")}
    assert SOURCES["tokens"].fields(absent, 8, 2)["inputs"].shape == (2, 8)
    with pytest.raises(SexpError, match="must be one of 'uint16', 'uint32', got 'int8'"):
        SOURCES["tokens"].fields({"path": str(odd), "dtype": "int8"}, 8, 2)
    with pytest.raises(SexpError, match="option :path must be a non-empty string, got 3"):
        SOURCES["tokens"].fields({"path": 3}, 8, 2)
    with pytest.raises(SexpError, match="option :path must be a non-empty string"):
        SOURCES["text"].fields({}, 8, 2)


def test_npy_fields_come_from_headers_and_match_batches(npy_files):
    paths, x, y, y_reg = npy_files
    opts = {"features": str(paths["x"]), "labels": str(paths["y"])}
    fields = SOURCES["npy"].fields(opts, 1, 4)
    assert {k: (v.shape, v.dtype) for k, v in fields.items()} == {
        "inputs": ((4, 3, 4), "f32"),
        "targets": ((4,), "i64"),
    }
    assert SOURCES["npy"].tokens_field is None
    loader = SOURCES["npy"].factory(opts, 1, 4, 0)
    b = check_fields("npy", opts, 1, 4, loader)
    for xi, yi in zip(b["inputs"], b["targets"], strict=True):
        (row,) = [i for i in range(10) if np.array_equal(x[i].astype(np.float32), xi)]
        assert y[row] == yi


def test_npy_float_labels_are_regression_targets(npy_files):
    paths, x, _, y_reg = npy_files
    opts = {"features": str(paths["x"]), "labels": str(paths["y_reg"])}
    fields = SOURCES["npy"].fields(opts, 1, 5)
    assert fields["targets"].shape == (5, 2) and fields["targets"].dtype == "f32"
    check_fields("npy", opts, 1, 5, SOURCES["npy"].factory(opts, 1, 5, 0))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39])
def test_npy_non_finite_features_are_found(bad, tmp_path, npy_files):
    paths, x, _, _ = npy_files
    x = x.copy()
    x[7, 2, 1] = bad
    np.save(tmp_path / "bad.npy", x)
    opts = {"features": str(tmp_path / "bad.npy"), "labels": str(paths["y"])}
    with pytest.raises(SexpError) as e:
        SOURCES["npy"].factory(opts, 1, 2, 0)
    assert e.value.code == "E-DATA-003"
    assert "\n" not in str(e.value)
    if not np.isfinite(bad):
        assert "at record 7" in str(e.value)


def test_npy_non_finite_labels_are_found(tmp_path, npy_files):
    paths = npy_files[0]
    y = np.zeros(10, dtype=np.float32)
    y[3] = np.nan
    np.save(tmp_path / "y.npy", y)
    opts = {"features": str(paths["x"]), "labels": str(tmp_path / "y.npy")}
    with pytest.raises(SexpError, match="labels .* holds nan at record 3"):
        SOURCES["npy"].factory(opts, 1, 2, 0)


def test_npy_input_errors(tmp_path, npy_files):
    paths, *_ = npy_files
    np.save(tmp_path / "y9.npy", np.zeros(9, dtype=np.int64))
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    np.save(tmp_path / "y2d.npy", np.zeros((10, 2), dtype=np.int64))
    cases = [
        ({"labels": str(tmp_path / "y9.npy")}, "E-DATA-004", "has 10 records but"),
        ({"labels": str(tmp_path / "missing.npy")}, "E-DATA-001", "no such file"),
        ({"features": str(tmp_path / "junk.npy")}, "E-DATA-001", "is not a readable .npy array"),
        ({"features": str(tmp_path / "s.npy")}, "E-DATA-004", "not a number type"),
        ({"labels": str(tmp_path / "y2d.npy")}, "E-DATA-004", "one class per record"),
        ({"labels": 7}, "E-DATA-005", "option :labels must be a non-empty string"),
    ]
    base = {"features": str(paths["x"]), "labels": str(paths["y"])}
    for change, code, message in cases:
        with pytest.raises(SexpError) as e:
            SOURCES["npy"].fields({**base, **change}, 1, 2)
        assert e.value.code == code, change
        assert message in str(e.value), change
    with pytest.raises(SexpError) as e:
        SOURCES["npy"].fields(base, 1, 11)
    assert e.value.code == "E-DATA-002" and "too few for one batch of 11" in str(e.value)
