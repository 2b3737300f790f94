"""`sexpgpu evaluate CHECKPOINT`: the run's own numbers, from less than a resume reads."""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path

from tests.e2e.helpers import events, refused_in_process, run_sexpgpu, sexpgpu_env, start_sexpgpu
from tests.foundation.pluginkit import make_plugin

from .kit import RUN, eval_points, one_line, the_run, train


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def evaluate(workdir: Path, *args: str):
    return run_sexpgpu("evaluate", *args, "--metrics-dir", "m", cwd=workdir)


def test_numbers_are_bit_identical_to_the_runs_own_passes(workdir):
    train(workdir)
    for step in (2, 4, 6):
        result = evaluate(workdir, f"ck/step-{step:08d}", "--pass", "probe")
        assert result.returncode == 0, result.stderr
    ran = eval_points(workdir, source=None)
    again = eval_points(workdir, source="evaluate")
    assert sorted(again) == sorted(k for k in ran if k[1].startswith("probe/"))
    assert len(again) == 15  # three steps, five metrics
    for key, values in again.items():
        assert values == ran[key], key  # the same float, bit for bit


def test_points_are_marked_and_their_pass_and_step_named(workdir):
    train(workdir)
    assert evaluate(workdir, "ck/step-00000006").returncode == 0
    assert evaluate(workdir, "ck/step-00000006", "--pass", "final").returncode == 0
    ours = [e for e in events(the_run(workdir)) if e.get("source") == "evaluate"]
    assert {e["evaluation"] for e in ours} == {"probe@6", "final@6"}
    assert all(e["checkpoint"] == "ck/step-00000006" for e in ours)
    finals = [e for e in ours if e["evaluation"] == "final@6"]
    # evaluated twice: the same numbers, recognisable by pass and step, each message new
    assert len(finals) == 2 and finals[0]["value"] == finals[1]["value"]
    assert finals[0]["id"] != finals[1]["id"]


def test_it_never_reads_states_and_writes_nothing_into_the_checkpoint(workdir):
    train(workdir)
    step = workdir / "ck" / "step-00000004"
    (step / "states.safetensors").write_bytes(b"not a safetensors file")
    before = digests(step)
    result = evaluate(workdir, str(step))
    assert result.returncode == 0, result.stderr
    assert digests(step) == before
    assert eval_points(workdir, source="evaluate")[(4, "probe/loss")]


LOGGING_DATA = """
import os

import numpy as np

from sexpgpu.extension import DataSourceInfo
from sexpgpu.lang.ir import TensorType
from sexpgpu.hookspecs import hookimpl


class Loader:
    def __init__(self, seq, batch):
        with open(os.environ["LOADER_LOG"], "a") as log:
            log.write("opened\\n")
        self.shape, self.at = (batch, seq), 0

    def next_batch(self):
        self.at += 1
        inputs = np.full(self.shape, self.at % 32, dtype=np.int64)
        return {"inputs": inputs, "targets": (inputs + 1) % 32}

    def position(self):
        return {"at": self.at}

    def restore(self, position):
        self.at = position["at"]


def fields(options, seq, batch):
    t = TensorType((batch, seq), "i64")
    return {"inputs": t, "targets": t}


@hookimpl
def sexpgpu_data_sources():
    return [DataSourceInfo("logged", {}, fields, lambda o, seq, batch, seed: Loader(seq, batch))]
"""


def test_it_never_opens_the_training_loader(workdir, tmp_path):
    plugin = make_plugin(
        tmp_path / "plugins",
        "sexpgpu-logged-data",
        {"sexpgpu_logged": LOGGING_DATA},
        {"logged": "sexpgpu_logged"},
    )
    log = tmp_path / "loader.log"
    env = sexpgpu_env(PYTHONPATH=str(plugin), LOADER_LOG=str(log))
    text = (workdir / "eval.sx").read_text()
    text = text.replace(
        "(defdata train (arithmetic :digits 3) :seq 32 :batch 16)",
        "(defdata train (logged) :seq 8 :batch 4)\n"
        "(defdata held (arithmetic :digits 3) :seq 32 :batch 16)",
    ).replace(":every 2 :batches batches", ":every 2 :data held :batches batches")
    (workdir / "eval.sx").write_text(text.replace("(eval final :every 3 :metrics (loss))", ""))
    result = run_sexpgpu(*RUN, cwd=workdir, env=env)
    assert result.returncode == 0, result.stderr
    assert log.read_text() == "opened\n"  # the run opened it, once
    result = run_sexpgpu("evaluate", "ck/step-00000006", "--metrics-dir", "m", cwd=workdir, env=env)
    assert result.returncode == 0, result.stderr
    assert log.read_text() == "opened\n"  # evaluate did not
    assert eval_points(workdir, source="evaluate")[(6, "probe/loss")]


def test_an_incomplete_checkpoint_is_one_line(workdir):
    train(workdir)
    (workdir / "ck" / "step-00000004" / "experiment.json").unlink()
    result = evaluate(workdir, "ck/step-00000004")
    assert result.returncode != 0
    assert "E-CKPT-001" in one_line(result.stderr)
    assert "not a complete checkpoint" in result.stderr


def test_another_programs_checkpoint_is_said_as_a_resume_says_it(workdir):
    train(workdir)
    other = (workdir / "eval.sx").read_text().replace("(net 32 8)", "(net 32 16)")
    (workdir / "other.sx").write_text(other)
    result = evaluate(workdir, "ck/step-00000004", "--file", "other.sx")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if line.strip() and line[0] != "{"]
    assert said[0].startswith("sexpgpu evaluate: E-CKPT-004: ")
    assert any(line.startswith("  model.embed") for line in said[1:]), said


def test_a_changed_source_is_evaluated_and_what_moved_annotated(workdir):
    train(workdir)
    with (workdir / "eval.sx").open("a") as f:
        f.write("\n; an edit after the run\n")
    result = evaluate(workdir, "ck/step-00000006", "--pass", "probe")
    assert result.returncode == 0, result.stderr
    (note,) = [
        e["text"]
        for e in events(the_run(workdir))
        if e["kind"] == "annotation" and e.get("source") == "evaluate"
    ]
    first, moved = note.splitlines()
    assert first == "evaluated from ck/step-00000006"
    assert moved.startswith("source eval.sx ")
    # the parameters are the checkpoint's: the numbers are still the run's
    assert (
        eval_points(workdir, source="evaluate")[(6, "probe/loss")]
        == eval_points(workdir, source=None)[(6, "probe/loss")]
    )


def test_a_run_without_passes_and_an_unknown_pass_are_one_line(workdir):
    train(workdir)
    result = evaluate(workdir, "ck/step-00000002", "--pass", "prob")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "sexpgpu evaluate: the run has no eval pass 'prob'; its passes: probe, final"
    )


def test_a_damaged_params_file_is_refused(workdir):
    train(workdir)
    params = workdir / "ck" / "step-00000002" / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[-1] ^= 0xFF
    params.write_bytes(bytes(data))
    result = evaluate(workdir, "ck/step-00000002")
    assert result.returncode != 0
    assert "E-CKPT" in one_line(result.stderr)
    assert not eval_points(workdir, source="evaluate")
    assert json.loads((workdir / "ck" / "step-00000002" / "state.json").read_text())["step"] == 2


def test_a_signal_stops_the_pass_in_flight_and_it_reports_nothing(workdir):
    train(workdir)
    slow = (
        (workdir / "eval.sx")
        .read_text()
        .replace('(defknob batches 2 "', '(defknob batches 1000000 "')
    )
    (workdir / "slow.sx").write_text(slow)
    # the same run from an edited file: the pass now takes a million batches
    proc = start_sexpgpu(
        "evaluate", "ck/step-00000002", "--file", "slow.sx", "--metrics-dir", "m", cwd=workdir
    )
    try:
        deadline = time.monotonic() + 120
        while not any(e.get("source") == "evaluate" for e in events(the_run(workdir))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)  # the annotation comes just before the pass starts
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "sexpgpu evaluate: interrupted by SIGTERM at step 2" in err
    assert not eval_points(workdir, source="evaluate")


def test_a_checkpoint_of_another_run_is_one_line(workdir):
    train(workdir)
    other = (workdir / "eval.sx").read_text().replace("(defrun evalrun", "(defrun otherrun")
    (workdir / "other.sx").write_text(other)
    result = evaluate(workdir, "ck/step-00000004", "--file", "other.sx")
    assert result.returncode == 1
    assert one_line(result.stderr) == (
        "sexpgpu evaluate: E-EVAL-002: the checkpoint is of the run 'evalrun', "
        "and other.sx defines 'otherrun'"
    )
    assert not eval_points(workdir, source="evaluate")


def test_an_evaluator_needs_no_training_data(workdir):
    """An evaluator on another machine has the checkpoints and its passes' data, not
    the training set: compiling checks only the files a pass reads, when it reads them."""
    rng = __import__("random").Random(3)
    for name in ("train.bin", "held.bin"):
        (workdir / name).write_bytes(bytes(rng.randrange(32) for _ in range(4096)))
    text = (workdir / "eval.sx").read_text()
    text = text.replace(
        "(defdata train (arithmetic :digits 3) :seq 32 :batch 16)",
        '(defdata train (text :path "train.bin") :seq 32 :batch 16)\n'
        '(defdata held (text :path "held.bin") :seq 32 :batch 16)',
    ).replace(":every 2 :batches batches", ":every 2 :data held :batches batches")
    (workdir / "eval.sx").write_text(text.replace(":model (net 32 8)", ":model (net 256 8)"))
    train(workdir)
    (workdir / "train.bin").unlink()
    result = evaluate(workdir, "ck/step-00000004", "--pass", "probe")
    assert result.returncode == 0, result.stderr
    assert (
        eval_points(workdir, source="evaluate")[(4, "probe/loss")]
        == eval_points(workdir, source=None)[(4, "probe/loss")]
    )
    # the run itself still checks every file before its first step, with the place
    run = refused_in_process(*RUN, "--resume", "latest", cwd=workdir)
    assert run.returncode != 0 and "E-DATA-001" in one_line(run.stderr)
    assert one_line(run.stderr).startswith("eval.sx:")
    # the pass's own data is read, and its absence is one line
    (workdir / "held.bin").unlink()
    result = evaluate(workdir, "ck/step-00000004", "--pass", "probe")
    assert result.returncode != 0
    line = one_line(result.stderr)
    assert line.startswith("eval.sx:") and "E-DATA-001" in line and "held.bin" in line, line
