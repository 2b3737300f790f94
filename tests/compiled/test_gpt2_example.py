"""examples/gpt2-small.sx: GPT-2 small as a GPU user knows it, checked without training."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e.helpers import EXAMPLES, run_sexpgpu


def test_sexpgpu_check_shows_gpt2_small_at_124m_parameters(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "gpt2-small.sx", tmp_path)
    # the token file the example names is made by its script, as a user makes it
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_gpt2_tokens.py"), str(tmp_path / "gpt2-tokens.bin")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote 65537 tokens" in made.stdout
    checked = run_sexpgpu("check", "gpt2-small.sx", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    lines = checked.stdout.splitlines()
    assert lines[-1] == "196 parameters, 124,439,808 values (124,439,808 trainable)"
    by_path = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert by_path["model.wte.table"][:3] == ["[50257,", "768]", "f32"]
    assert by_path["model.wpe"][:3] == ["[1024,", "768]", "f32"]
    assert (
        "model.blocks.11.attn.q.weight" in by_path
        and "model.blocks.12.attn.q.weight" not in by_path
    )
    assert not any(path.startswith("model.head") for path in by_path)  # tied to wte
    assert "run gpt2-small" in lines[0]
