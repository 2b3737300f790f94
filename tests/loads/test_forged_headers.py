"""A forged :load header, as `sexpgpu run` meets it in a subprocess: a negative or
fractional offset or shape is one line with E-LOAD-002 and the parameter's position,
never rounded, read before the data, or a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import refused_in_process

from .helpers import said, write_project

GOOD = {
    "teacher.embed.weight": {"dtype": "F32", "shape": [32, 8], "data_offsets": [0, 1024]},
    "teacher.head.weight": {"dtype": "F32", "shape": [8, 32], "data_offsets": [1024, 2048]},
}
FORGED = {
    "negative offsets": {"data_offsets": [-1024, 0]},
    "a fractional shape": {"shape": [32, 8.5]},
    "a whole number written as a fraction": {"shape": [32.0, 8]},
    "a fractional offset": {"data_offsets": [0, 1024.5]},
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_entry_is_one_line_with_e_load_002(tmp_path: Path, case: str) -> None:
    write_project(tmp_path)
    header = {**GOOD, "teacher.embed.weight": {**GOOD["teacher.embed.weight"], **FORGED[case]}}
    raw = json.dumps(header).encode()
    data = len(raw).to_bytes(8, "little") + raw + bytes(2048)
    (tmp_path / "teacher.safetensors").write_bytes(data)
    done = refused_in_process("run", "loads.sx", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = said(done.stderr)
    # the position of the teacher's parameter (a source error is printed bare)
    assert line.removeprefix("sexpgpu run: ").startswith("loads.sx:7:10: ")
    assert line.endswith(
        "E-LOAD-002: teacher.safetensors is not a safetensors file: the header's entry for "
        "teacher.embed.weight has no dtype, shape and offsets (whole numbers of at least 0)"
    )
    assert not (tmp_path / "ckpt").exists()  # a refused run leaves no folder behind
    assert not (tmp_path / "sexpgpu-runs").exists()
