"""The docs say what the product does: every `.sx` block in README.md and docs/*.md
compiles with `sexpgpu check`, and docs/checkpoints.md's `sexpgpu checkpoint` sample is
what a real run of examples/my-run.sx prints.

A block's fence says what it is: ```` ```lisp ```` a whole program (checked as it is),
```` ```lisp forms ```` top-level forms (checked with a small run around them, once per
``defdata`` they declare, each read by that run), ```` ```lisp fragment ```` part of a form
or forms that lean on others around them (read, so at least their brackets and tokens
are right).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sexpgpu.lang.reader import read
from tests import inprocess

ROOT = Path(__file__).resolve().parents[2]
SEXPGPU = str(Path(sys.executable).with_name("sexpgpu"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("", "forms", "fragment")

# The run put around a block of forms; its names cannot clash with a doc's.
HARNESS = """
(defmodel doc-check-net () (param w [2] :init ones) (forward () w))
(defdata doc-check-data (arithmetic :digits 1) :seq 8 :batch 2)
(defrun doc-check :model (doc-check-net) :data {data} :loss (sum (model))
  :optimizer (sgd :lr 0.1) :steps 1)
"""

# Files the docs' examples name, made where a block is checked.
DOC_FILES = {"data/train.bin": bytes(range(256)) * 40}  # 5120 uint16 tokens


def blocks() -> list[tuple[str, str, str]]:
    """Every ```lisp block: (where, kind, text)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```lisp( [a-z]+)?\n(.*?)^```", text, re.S | re.M):
            line = text[: m.start()].count("\n") + 1
            kind = (m.group(1) or "").strip()
            found.append((f"{doc.relative_to(ROOT)}:{line}", kind, m.group(2)))
    return found


BLOCKS = blocks()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SEXPGPU_")}


def sexpgpu(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SEXPGPU, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120
    )


def check(text: str, folder: Path) -> None:
    """`sexpgpu check` of ``text``, in this process (it trains nothing: tests/inprocess.py)."""
    for name, data in DOC_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "block.sx").write_text(text)
    r = inprocess.sexpgpu("check", "block.sx", cwd=folder, env=_env())
    assert r.returncode == 0, f"{r.stderr}\n--- block.sx:\n{text}"


def test_the_docs_have_sx_blocks_of_each_kind() -> None:
    assert {kind for _, kind, _ in BLOCKS} == set(KINDS)


@pytest.mark.parametrize("where,kind,text", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_a_docs_sx_block_compiles(where, kind, text, tmp_path) -> None:
    assert kind in KINDS, f"{where}: unknown block kind {kind!r}; kinds: {KINDS}"
    if kind == "fragment":
        read(text, where)
        return
    if kind == "":
        check(text, tmp_path)
        return
    for data in re.findall(r"\(defdata\s+([^\s()]+)", text) or ["doc-check-data"]:
        check(text + HARNESS.format(data=data), tmp_path)


def test_a_wrong_block_is_caught(tmp_path) -> None:
    """The check above can fail: the bug the docs had (a symbol for a string)."""
    text = "(defdata val (sort :vocab 16 :split val) :seq 16 :batch 32)\n"
    with pytest.raises(AssertionError, match="unknown name 'val'"):
        check(text + HARNESS.format(data="val"), tmp_path)


# ---------------------------------------------------------------- docs/checkpoints.md's sample

HEX = re.compile(r"\b[0-9a-f]{6,64}\b")


def _sample() -> tuple[str, list[str]]:
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    m = re.search(r"^```console\n\$ sexpgpu checkpoint (\S+)\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/checkpoints.md has no `sexpgpu checkpoint` sample"
    return m.group(1), m.group(2).splitlines()


CPU_CHOICE = re.compile(r"^(  (?:cpu\.[a-z.]+|torch\.version) +)\S.*$")


def _comparable(lines: list[str], location: str) -> list[str]:
    # hashes vary with the prelude's text and the slug's suffix, the CPU choices'
    # values with the machine (docs/determinism.md); nothing else may
    return [
        CPU_CHOICE.sub(
            r"\1<machine>", HEX.sub("<hex>", line.replace(location, "<location>"))
        ).rstrip()
        for line in lines
    ]


def test_the_checkpoint_sample_is_what_examples_my_run_prints(tmp_path) -> None:
    shown_location, sample = _sample()
    folder = tmp_path / "ck"
    r = sexpgpu(
        "run", str(ROOT / "examples" / "my-run.sx"), "--checkpoint-dir", str(folder), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    step = shown_location.rsplit("/", 1)[1]
    real = sexpgpu("checkpoint", str(folder / step), cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    assert _comparable(real.stdout.splitlines(), str(folder / step)) == _comparable(
        sample, shown_location
    )
