"""The generated data sources: arithmetic, copy, sort, shapes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import sexpgpu_data
from sexpgpu.errors import SexpError
from sexpgpu_data import generated
from sexpgpu_data._common import resolve_options, rng_for
from tests.catalogs import project

SOURCES = {info.name: info for info in sexpgpu_data.data_sources()}
GENERATED = [
    ("arithmetic", {}, 16, 4),
    ("arithmetic", {"digits": 1}, 6, 3),
    ("arithmetic", {"digits": 5}, 40, 2),
    ("copy", {}, 16, 4),
    ("copy", {"vocab": 5, "length": 3}, 9, 2),
    ("sort", {}, 17, 4),
    ("sort", {"vocab": 30}, 8, 1),
    ("shapes", {}, 1, 4),
    ("shapes", {"classes": 8, "size": 12}, 1, 3),
]
DTYPES = {"i64": np.int64, "f32": np.float32}


def batches(name, options, seq, batch, seed, count):
    loader = SOURCES[name].factory(options, seq, batch, seed)
    return [loader.next_batch() for _ in range(count)]


def same(a, b):
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a
    )


def test_every_source_is_registered_through_the_entry_point():
    names = {info.name for info in project().available("sexpgpu_data_sources")}
    assert {"arithmetic", "copy", "sort", "shapes", "text", "tokens", "npy"} <= names


def test_importing_the_plugin_does_not_import_torch():
    code = "import sys, sexpgpu_data; sexpgpu_data.data_sources(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name,options,seq,batch", GENERATED)
def test_fields_match_batches(name, options, seq, batch):
    fields = SOURCES[name].fields(options, seq, batch)
    for b in batches(name, options, seq, batch, seed=3, count=2):
        assert set(b) == set(fields)
        for key, ttype in fields.items():
            assert b[key].shape == ttype.shape, key
            assert b[key].dtype == DTYPES[ttype.dtype], key
    if SOURCES[name].tokens_field is not None:
        assert SOURCES[name].tokens_field in fields


@pytest.mark.parametrize("name,options,seq,batch", GENERATED)
def test_a_seed_fixes_the_stream_and_another_seed_changes_it(name, options, seq, batch):
    a = batches(name, options, seq, batch, seed=11, count=3)
    b = batches(name, options, seq, batch, seed=11, count=3)
    c = batches(name, options, seq, batch, seed=12, count=3)
    assert all(same(x, y) for x, y in zip(a, b, strict=True))
    assert not all(same(x, y) for x, y in zip(a, c, strict=True))
    # Consecutive batches differ too: the index is part of the key.
    assert not same(a[0], a[1])


@pytest.mark.parametrize("name,options,seq,batch", GENERATED)
def test_restore_continues_with_the_batches_that_would_have_come(name, options, seq, batch):
    loader = SOURCES[name].factory(options, seq, batch, 5)
    for _ in range(3):
        loader.next_batch()
    saved = loader.position()
    assert saved == {"index": 3}
    expected = [loader.next_batch() for _ in range(4)]
    fresh = SOURCES[name].factory(options, seq, batch, 5)
    fresh.restore(saved)
    got = [fresh.next_batch() for _ in range(4)]
    assert all(same(x, y) for x, y in zip(expected, got, strict=True))
    assert fresh.position() == loader.position() == {"index": 7}


def test_arithmetic_rows_are_correct_sums_and_only_the_answer_is_scored():
    digits, seq = 3, 20
    b = SOURCES["arithmetic"].factory({"digits": digits}, seq, 64, 0).next_batch()
    pad, plus, eq, end = (
        generated.ARITH_PAD,
        generated.ARITH_PLUS,
        generated.ARITH_EQUALS,
        generated.ARITH_END,
    )
    eq_at = 2 * digits + 1
    for x, t in zip(b["inputs"], b["targets"], strict=True):
        assert x.max() < 16 and x.min() >= 0
        a = int("".join(map(str, x[:digits])))
        bb = int("".join(map(str, x[digits + 1 : eq_at])))
        assert x[digits] == plus and x[eq_at] == eq
        answer = x[eq_at + 1 : eq_at + 2 + digits]
        assert int("".join(map(str, answer))) == a + bb
        assert x[eq_at + 2 + digits] == end
        assert (x[eq_at + 3 + digits :] == pad).all()
        # Targets: the next token at the answer digits and the end token, -1 elsewhere.
        scored = np.flatnonzero(t != -1)
        assert scored.tolist() == list(range(eq_at, eq_at + digits + 2))
        assert (t[scored[:-1]] == x[scored[:-1] + 1]).all()
        assert t[scored[-1]] == end


def test_arithmetic_covers_the_whole_operand_range():
    b = SOURCES["arithmetic"].factory({"digits": 2}, 12, 512, 1).next_batch()
    first = b["inputs"][:, 0] * 10 + b["inputs"][:, 1]
    assert first.min() < 10 and first.max() > 89


@pytest.mark.parametrize("name", ["copy", "sort"])
def test_copy_and_sort_answers(name):
    vocab, seq = 10, 13
    b = SOURCES[name].factory({"vocab": vocab}, seq, 32, 4).next_batch()
    length = seq // 2
    for x, t in zip(b["inputs"], b["targets"], strict=True):
        prompt = x[:length]
        assert prompt.max() <= vocab - 3
        assert x[length] == vocab - 2
        want = np.sort(prompt) if name == "sort" else prompt
        assert (t[:length] == -1).all()
        assert (t[length : 2 * length] == want).all()
        assert (x[length + 1 : 2 * length] == want[:-1]).all()
        assert (t[2 * length :] == -1).all()
        assert (x[2 * length + 1 :] == vocab - 1).all()


def test_sort_answer_differs_from_copy_answer():
    b = SOURCES["sort"].factory({}, 16, 16, 0).next_batch()
    assert (np.diff(b["targets"][:, 8:16], axis=1) >= 0).all()
    assert not (b["targets"][:, 8:16] == b["inputs"][:, :8]).all()


def test_shapes_classes_are_distinct_and_labels_in_range():
    size = 16
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    masks = [generated._draw(k, yy, xx, 7.5, 7.5, 5.0) for k in range(len(generated.SHAPE_NAMES))]
    for i in range(len(masks)):
        assert masks[i].sum() > 4
        for j in range(i):
            assert (masks[i] != masks[j]).sum() >= 4, (i, j)
    b = SOURCES["shapes"].factory({"classes": 3}, 1, 300, 0).next_batch()
    assert set(np.unique(b["targets"]).tolist()) == {0, 1, 2}
    assert np.isfinite(b["inputs"]).all()
    # A shape is drawn: every image has a clear bright region above the noise.
    assert (b["inputs"].reshape(300, -1).max(axis=1) > 0.5).all()


@pytest.mark.parametrize(
    "name,options,seq,message",
    [
        ("arithmetic", {"digits": 3}, 11, "needs :seq of at least 12"),
        ("arithmetic", {"digits": "3"}, 32, "must be an integer, got '3'"),
        ("arithmetic", {"digits": True}, 32, "must be an integer, got True"),
        ("arithmetic", {"digits": 3.0}, 32, "must be an integer, got 3.0"),
        ("arithmetic", {"digits": 0}, 32, "must be between 1 and 18, got 0"),
        ("arithmetic", {"digit": 3}, 32, "has no option ':digit' (options: :digits, :split)"),
        ("copy", {"vocab": 3}, 16, "must be at least 4"),
        ("copy", {"length": 9}, 16, "needs :seq of at least 18"),
        ("sort", {}, 1, "needs :seq of at least 2"),
        ("shapes", {"classes": 9}, 1, "between 2 and 8"),
        ("shapes", {"size": "big"}, 1, "must be an integer"),
    ],
)
def test_bad_options_are_one_line_errors_at_fields_and_factory(name, options, seq, message):
    for call in (
        lambda: SOURCES[name].fields(options, seq, 4),
        lambda: SOURCES[name].factory(options, seq, 4, 0),
    ):
        with pytest.raises(SexpError) as e:
            call()
        assert message in str(e.value)
        assert e.value.code == "E-DATA-005"
        assert "\n" not in str(e.value)


def test_option_keys_may_be_written_as_in_a_sx_file():
    defaults = {"min_len": 1, "vocab": 16}
    assert resolve_options("x", defaults, {"min-len": 4}) == {"min_len": 4, "vocab": 16}
    assert resolve_options("x", defaults, {"min_len": 5}) == {"min_len": 5, "vocab": 16}
    with pytest.raises(SexpError, match=r"no option ':max-len' \(options: :min-len, :vocab\)"):
        resolve_options("x", defaults, {"max_len": 3})


@pytest.mark.parametrize("bad_batch", [0, -1, "4", True])
def test_bad_batch_is_rejected(bad_batch):
    with pytest.raises(SexpError, match=":batch must be a positive integer"):
        SOURCES["arithmetic"].fields({}, 16, bad_batch)


@pytest.mark.parametrize("position", [{}, {"index": -1}, {"index": "3"}, {"epoch": 0}])
def test_a_foreign_position_is_refused(position):
    loader = SOURCES["copy"].factory({}, 8, 2, 0)
    with pytest.raises(SexpError) as e:
        loader.restore(position)
    assert e.value.code == "E-DATA-006"


@pytest.mark.slow
def test_a_small_cnn_learns_shapes():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    nn = torch.nn
    info = SOURCES["shapes"]
    loader = info.factory({"classes": 4, "size": 16}, 1, 32, 0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(150):
        b = loader.next_batch()
        loss = nn.functional.cross_entropy(
            net(torch.from_numpy(b["inputs"])), torch.from_numpy(b["targets"])
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Held-out images from another seed; chance is 0.25.
    held = info.factory({"classes": 4, "size": 16}, 1, 512, 99).next_batch()
    with torch.no_grad():
        guess = net(torch.from_numpy(held["inputs"])).argmax(1).numpy()
    assert (guess == held["targets"]).mean() > 0.9


@pytest.mark.parametrize("name,options,seq,batch", GENERATED)
def test_a_split_is_another_stream_from_the_same_seed(name, options, seq, batch):
    train = batches(name, options, seq, batch, seed=1, count=2)
    named = batches(name, {**options, "split": "train"}, seq, batch, seed=1, count=2)
    held = batches(name, {**options, "split": "eval"}, seq, batch, seed=1, count=2)
    assert all(same(a, b) for a, b in zip(train, named, strict=True))
    assert not any(same(a, b) for a, b in zip(train, held, strict=True))
    assert SOURCES[name].fields({**options, "split": "eval"}, seq, batch) == SOURCES[name].fields(
        options, seq, batch
    )
    with pytest.raises(SexpError, match="option :split must be a non-empty string"):
        SOURCES[name].fields({**options, "split": 3}, seq, batch)


def test_batch_zero_is_the_documented_function_of_the_seed():
    # Pins the key layout (seed, "data", name, index): changing it breaks resumes
    # of runs started with an older version.
    rng = rng_for(7, "copy", 0)
    prompt = rng.integers(0, 14, size=(2, 4), dtype=np.int64)
    b = SOURCES["copy"].factory({}, 8, 2, 7).next_batch()
    assert (b["inputs"][:, :4] == prompt).all()


def test_every_option_is_documented():
    for info in SOURCES.values():
        assert set(info.option_docs) == set(info.options), info.name
        assert info.doc
