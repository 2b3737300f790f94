"""Bad input through `sexpgpu run`: one line, the right exit code, nothing started.

Every error here is found before the first step (compiling, or opening the data),
so no run starts: no metrics experiment, no checkpoint. Those found before the
program is lowered run in this process (tests/inprocess.py ``refused``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.helpers import experiments, refused_in_process, run_sexpgpu, sexpgpu_in_process

from .kit import NPY_SX, TEXT_SX, TOKENS_SX, error_line

CKPT = ["--checkpoint-dir", "ckpt", "--metrics-dir", "m"]


def _nothing_started(workdir: Path) -> None:
    assert experiments(workdir / "m") == []
    ckpt = workdir / "ckpt"
    assert not ckpt.exists() or not any(p.name.startswith("step-") for p in ckpt.iterdir())


@pytest.fixture
def text_run(tmp_path: Path) -> Path:
    (tmp_path / "text.sx").write_text(TEXT_SX)
    return tmp_path


def test_a_missing_text_file_is_e_data_001_at_the_defdata(text_run):
    line = error_line(refused_in_process("run", "text.sx", *CKPT, cwd=text_run))
    # Positioned at the source in the defdata form (line 10), with the stable code.
    assert re.fullmatch(
        r"text\.sx:10:\d+: E-DATA-001: data source 'text': no such file 'data\.txt'", line
    ), line
    _nothing_started(text_run)


def test_a_text_file_too_short_for_one_batch_is_e_data_002(text_run):
    # :seq 8 :batch 4 needs 4 windows of 9 bytes starting every 8: 33 bytes.
    (text_run / "data.txt").write_bytes(b"x" * 32)
    line = error_line(refused_in_process("run", "text.sx", *CKPT, cwd=text_run))
    assert line.startswith("text.sx:10:"), line
    assert "E-DATA-002: data source 'text': 'data.txt' holds 32 bytes" in line
    assert "(needs at least 33)" in line
    _nothing_started(text_run)
    # One byte more is enough: the same command trains.
    (text_run / "data.txt").write_bytes(b"x" * 33)
    ok = run_sexpgpu("run", "text.sx", *CKPT, cwd=text_run)
    assert ok.returncode == 0, ok.stderr


def test_a_tokens_file_too_short_or_of_the_other_dtype_is_e_data_002(tmp_path):
    (tmp_path / "tok.sx").write_text(TOKENS_SX)
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "train.bin")
    line = error_line(refused_in_process("run", "tok.sx", *CKPT, cwd=tmp_path))
    assert "E-DATA-002: data source 'tokens': 'train.bin' holds 20 tokens" in line, line
    # An odd number of bytes is not a whole number of uint16 tokens.
    (tmp_path / "train.bin").write_bytes(b"\x01" * 101)
    line = error_line(refused_in_process("run", "tok.sx", *CKPT, cwd=tmp_path))
    assert line.startswith("tok.sx:") and "E-DATA-002" in line, line
    (tmp_path / "train.bin").unlink()
    line = error_line(refused_in_process("run", "tok.sx", *CKPT, cwd=tmp_path))
    assert "E-DATA-001" in line and "'train.bin'" in line, line
    _nothing_started(tmp_path)


def test_a_nan_in_npy_features_is_e_data_003_naming_the_record(tmp_path):
    (tmp_path / "npy.sx").write_text(NPY_SX)
    x = np.random.default_rng(0).random((16, 5), dtype=np.float32)
    x[9, 2] = np.nan
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(16) % 3)
    line = error_line(run_sexpgpu("run", "npy.sx", *CKPT, cwd=tmp_path))
    # found as the data opens, at the defdata, as the file checks before it are
    assert line.startswith("npy.sx:7:10: E-DATA-003: "), line
    assert "'x.npy'" in line and "nan at record 9" in line, line
    _nothing_started(tmp_path)


def test_a_malformed_sx_is_one_positioned_line(tmp_path):
    lines = TEXT_SX.splitlines()
    # Line 8 is "  (forward (tokens) ...)))", the model's last: drop one closing bracket,
    # and the error points where the unclosed defmodel opened.
    assert lines[7].startswith("  (forward")
    unclosed = [*lines[:7], lines[7][:-1], *lines[8:]]
    (tmp_path / "bad.sx").write_text("\n".join(unclosed) + "\n")
    line = error_line(refused_in_process("run", "bad.sx", *CKPT, cwd=tmp_path))
    assert line == "bad.sx:5:1: '(' is never closed", line

    # The data is read when its defdata is compiled, the forward when the defrun is.
    (tmp_path / "data.txt").write_bytes(b"x" * 100)
    (tmp_path / "typo.sx").write_text(TEXT_SX.replace("(matmul (take", "(matmull (take"))
    line = error_line(refused_in_process("run", "typo.sx", *CKPT, cwd=tmp_path))
    assert line == "typo.sx:8:22: unknown op 'matmull' (did you mean 'matmul'?)", line

    (tmp_path / "str.sx").write_text('(defknob path "data.txt)\n')
    line = error_line(refused_in_process("run", "str.sx", *CKPT, cwd=tmp_path))
    assert re.fullmatch(r"str\.sx:1:\d+: unterminated string", line), line
    _nothing_started(tmp_path)


def test_an_unknown_set_knob_or_bad_value_exits_2(text_run):
    line = error_line(
        refused_in_process("run", "text.sx", "--set", "nope=3", *CKPT, cwd=text_run), 2
    )
    assert line == "sexpgpu run: --set nope: unknown knob; knobs: path, steps, vocab", line
    line = error_line(
        refused_in_process("run", "text.sx", "--set", "steps=many", *CKPT, cwd=text_run), 2
    )
    assert "knob 'steps' takes an integer" in line, line
    line = error_line(
        refused_in_process("run", "text.sx", "--set", "steps", *CKPT, cwd=text_run), 2
    )
    assert "name=value" in line, line
    # an option's value click refuses is one line too, no usage block (issue 24, item 31)
    line = error_line(refused_in_process("run", "text.sx", "--steps", "0", *CKPT, cwd=text_run), 2)
    assert line == "sexpgpu run: Invalid value for '--steps': 0 is not in the range x>=1.", line
    _nothing_started(text_run)


def test_an_include_cycle_is_one_positioned_line_naming_it(tmp_path):
    (tmp_path / "lib.sx").write_text('(defknob width 4)\n(include "main.sx")\n')
    (tmp_path / "main.sx").write_text('(include "lib.sx")\n' + TEXT_SX)
    checked = sexpgpu_in_process("check", "main.sx", cwd=tmp_path)
    line = error_line(checked)
    assert line == "lib.sx:2:10: include cycle: main.sx -> lib.sx -> main.sx", line


def test_a_missing_sx_file_is_one_line(tmp_path):
    line = error_line(refused_in_process("run", "nothere.sx", *CKPT, cwd=tmp_path))
    assert line == "sexpgpu run: cannot read nothere.sx: No such file or directory", line
    _nothing_started(tmp_path)
