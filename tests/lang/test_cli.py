"""`sexpgpu check` and `sexpgpu compile` run as a user runs them: the console script in
a subprocess (``sexpgpu``), or, where a process adds nothing, its entry point in this
one (``in_process``, tests/inprocess.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lang_helpers import EXAMPLES, ROOT, cli_env

from tests import inprocess

SEXPGPU = str(Path(sys.executable).with_name("sexpgpu"))


def sexpgpu(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SEXPGPU, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=120
    )


def in_process(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return inprocess.sexpgpu(*args, cwd=cwd, env=cli_env())


def test_check_lists_parameters_and_total():
    r = sexpgpu("check", "examples/my-run.sx")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "examples/my-run.sx: run my-run, 4 steps, variant -"
    assert lines[1].split() == ["model.embed", "[32,", "8]", "f32", "trainable", "-"]
    assert lines[3].split() == ["model.noise", "[32]", "f32", "frozen", "-"]
    assert lines[-1] == "3 parameters, 544 values (512 trainable)"
    assert "Traceback" not in r.stderr


def test_check_with_knobs_and_variant():
    r = in_process(
        "check", "examples/tiny-lm.sx", "--variant", "wide", "--set", "layers=1", "--steps", "10"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "examples/tiny-lm.sx: run tiny-lm, 10 steps, variant wide"
    assert any(
        line.split()[:3] == ["model.blocks.0.attn.q.weight", "[64,", "64]"]
        for line in r.stdout.splitlines()
    )
    assert "model.blocks.1." not in r.stdout
    assert "model.norm.bias" in r.stdout and "no-decay" in r.stdout


def test_compile_shows_the_graph():
    r = in_process("compile", "examples/tiny-lm.sx", "--show", "graph")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "stage main: 200 steps on train" in out
    assert "= repeat %" in out and "[stack:model.blocks]" in out
    assert "attention" in out and "[attention:model.blocks.attn]" in out
    assert "-> loss %" in out and "eval probe" in out
    r = in_process("compile", "examples/my-run.sx", "--show", "all")
    assert r.returncode == 0, r.stderr
    for section in ("== graph", "== params", "== knobs", "== sources", "== sites"):
        assert section in r.stdout
    assert "<core>  " in r.stdout and "lr = 0.5  (default; default 0.5)" in r.stdout


def test_compile_shows_a_generator_with_its_graphs():
    r = in_process("compile", "examples/onpolicy-distill.sx", "--show", "graph")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = lines.index(
        "  generate from model: 16 new tokens after a prompt of 8, 2 samples per prompt "
        "(16 records), temperature 1.0 top-k 0 top-p 1.0 stop None; reward below"
    )
    assert lines[head + 1] == "    %0 = input :name sequence : i64[16, 32]"
    assert "    -> logits %4" in lines and "    -> reward %" in r.stdout
    assert r.stdout.count("generate from model") == 2  # the stage's, and the pass's
    r = in_process("compile", "examples/rl-sort.sx", "--show", "graph")
    assert "; reward the data source verifies" in r.stdout


def test_a_source_error_is_one_bare_line(tmp_path):
    bad = tmp_path / "my-run.sx"
    text = (EXAMPLES / "my-run.sx").read_text().replace("(matmul (take", "(matmull (take")
    bad.write_text(text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "matmull" in s)
    col = text.splitlines()[line - 1].index("matmull") + 1
    r = sexpgpu("check", "my-run.sx", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stdout == ""
    assert (
        r.stderr.strip() == f"my-run.sx:{line}:{col}: unknown op 'matmull' (did you mean 'matmul'?)"
    )


def test_malformed_file(tmp_path):
    bad = tmp_path / "bad.sx"
    bad.write_text("(defknob lr 0.5)\n(defrun r\n  :steps 4\n")
    r = sexpgpu("compile", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip() == f"{bad}:2:1: '(' is never closed"


def test_usage_errors_exit_2():
    r = in_process("check", "examples/my-run.sx", "--set", "lr=fast")
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == "sexpgpu check: --set lr=fast: knob 'lr' takes a number (its default is 0.5)"
    )
    r = in_process("check", "examples/my-run.sx", "--set", "nope")
    assert r.returncode == 2 and "--set takes name=value, got 'nope'" in r.stderr
    r = in_process("check", "examples/my-run.sx", "--variant", "big")
    assert r.returncode == 2 and "unknown variant 'big'; variants: none" in r.stderr
    r = in_process("check", "examples/my-run.sx", "--steps", "many")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_missing_file():
    r = in_process("check", "examples/nope.sx")
    assert r.returncode == 1
    assert (
        r.stderr.strip() == "sexpgpu check: cannot read examples/nope.sx: No such file or directory"
    )


def test_check_does_not_import_torch():
    code = (
        "import sys\n"
        "from sexpgpu_cli.main import main\n"
        "try:\n    main(['check', 'examples/tiny-lm.sx'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'check imported torch'\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
