"""Sources that are not regular files, or too large, are refused at the `include` in one
line, without reading them: `/dev/zero` once grew `sexpgpu check` to 23 GB."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, run_sexpgpu

from .kit import error_line


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: os.symlink("/dev/zero", d / "lib.sx"), "it is not a regular file"),
        (lambda d: os.mkfifo(d / "lib.sx"), "it is not a regular file"),
        (
            lambda d: (d / "lib.sx").write_bytes(b";" * ((16 << 20) + 1)),
            "it is larger than the 16777216 bytes a source may have",
        ),
    ],
    ids=["/dev/zero", "a FIFO", "17 MB"],
)
def test_an_include_that_is_no_source_file_is_refused(tmp_path: Path, make, reason):
    make(tmp_path)
    text = (EXAMPLES / "my-run.sx").read_text()
    (tmp_path / "main.sx").write_text('(include "lib.sx")\n' + text)
    line = error_line(run_sexpgpu("check", "main.sx", cwd=tmp_path, timeout=60))
    assert line == f"main.sx:1:10: cannot read 'lib.sx': {reason}", line


@pytest.mark.parametrize(
    "make",
    [lambda p: os.symlink("/dev/zero", p), lambda p: os.mkfifo(p)],
    ids=["/dev/zero", "a FIFO"],
)
def test_a_main_file_that_is_no_source_file_is_refused(tmp_path: Path, make):
    make(tmp_path / "main.sx")
    line = error_line(run_sexpgpu("check", "main.sx", cwd=tmp_path, timeout=60))
    assert line == "sexpgpu check: cannot read main.sx: it is not a regular file", line
