"""A run that moves to another machine keeps its bits (issue 18), through `sexpgpu` in
subprocesses. "Another machine" is simulated with the environment: more threads
(``OMP_NUM_THREADS``) and another ATen capability (``ATEN_CPU_CAPABILITY``)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    SEXPGPU,
    assert_same_tensors,
    events,
    experiments,
    run_sexpgpu,
    sexpgpu_env,
    step_dirs,
    tensors,
)

# tiny-lm without its eval pass: 1 thread against 2 differs within a few steps.
MODEL = """
(defknob steps 10 "training steps")
(defmodel gpt (vocab seq dim heads layers)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (layer blocks (repeat layers (transformer-block dim heads)))
  (layer norm (layer-norm dim))
  (layer head (linear dim vocab))
  (forward (ids) (-> (+ (embed ids) pos) blocks norm head)))
(defdata train (sort :vocab 16) :seq 16 :batch 32)
(defrun lm
  :model (gpt 16 16 32 4 2)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adamw :lr 0.003 :weight-decay 0.01 :clip 1.0)
  :steps steps
  :checkpoint-every 4
  :seed 1)
"""
FOUR, LAST = "step-00000004", "step-00000010"


def _run(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return run_sexpgpu(
        "run", "lm.sx", "--metrics-dir", "m", *args, cwd=folder, env=sexpgpu_env(**env)
    )


def _choices(checkpoint: Path) -> dict[str, str]:
    return json.loads((checkpoint / "experiment.json").read_text())["choices"]


def _resumed_lines(folder: Path) -> list[str]:
    (run_dir,) = experiments(folder / "m")
    texts = [e["text"] for e in events(run_dir) if e["kind"] == "annotation"]
    (resumed,) = [t for t in texts if t.startswith("resumed from")]
    return resumed.split("\n")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The 1-thread run never stopped: its checkpoints at steps 4, 8 and 10."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    (folder / "lm.sx").write_text(MODEL)
    done = _run(folder, "--checkpoint-dir", "ckpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr
    return folder / "ckpt"


@pytest.fixture
def moved(uninterrupted, tmp_path) -> Path:
    """A project on "another machine" holding the uninterrupted run's step 4 only."""
    (tmp_path / "lm.sx").write_text(MODEL)
    shutil.copytree(uninterrupted / FOUR, tmp_path / "ckpt" / FOUR)
    return tmp_path


def _other_capability(recorded: str) -> str:
    return "default" if recorded != "default" else "avx2"


def test_moved_to_more_threads_and_another_capability_ends_byte_identical(uninterrupted, moved):
    recorded = _choices(uninterrupted / FOUR)
    assert recorded["cpu.threads"] == "1"
    other = _other_capability(recorded["cpu.capability"])
    done = _run(
        moved, "--checkpoint-dir", "ckpt", "--resume", "latest",
        OMP_NUM_THREADS="2", ATEN_CPU_CAPABILITY=other,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_tensors(uninterrupted / LAST, moved / "ckpt" / LAST)
    assert _choices(moved / "ckpt" / LAST) == _choices(uninterrupted / LAST)
    assert _resumed_lines(moved) == [f"resumed from ckpt/{FOUR}"]
    (pinned,) = [
        json.loads(line)
        for line in done.stderr.splitlines()
        if "environment pinned to the checkpoint's choices" in line
    ]
    assert pinned["OMP_NUM_THREADS"] == "1"
    assert pinned["ATEN_CPU_CAPABILITY"] == recorded["cpu.capability"]


def test_choices_fresh_takes_this_machine_and_says_so(uninterrupted, moved):
    recorded = _choices(uninterrupted / FOUR)
    other = _other_capability(recorded["cpu.capability"])
    done = _run(
        moved, "--checkpoint-dir", "ckpt", "--resume", "latest", "--choices", "fresh",
        OMP_NUM_THREADS="2", ATEN_CPU_CAPABILITY=other,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _resumed_lines(moved) == [
        f"resumed from ckpt/{FOUR}",
        f"choice cpu.capability {recorded['cpu.capability']} -> {other}",
        "choice cpu.threads 1 -> 2",
    ]
    now = _choices(moved / "ckpt" / LAST)
    assert (now["cpu.threads"], now["cpu.capability"]) == ("2", other)
    # the pins are what kept the bits: without them the sums are another order
    assert tensors(moved / "ckpt" / LAST) != tensors(uninterrupted / LAST)


def _forge(checkpoint: Path, **choices: str) -> None:
    # experiment.json holds the other files' checksums, not its own: editing it is a forgery
    # the reader cannot tell, as a checkpoint written on another machine would be.
    path = checkpoint / "experiment.json"
    experiment = json.loads(path.read_text())
    experiment["choices"].update(choices)
    path.write_text(json.dumps(experiment))


def test_a_capability_this_processor_lacks_is_refused_with_e_choice_001(moved):
    lacking = "sve256" if platform.machine().lower() in ("x86_64", "amd64") else "avx512"
    _forge(moved / "ckpt" / FOUR, **{"cpu.capability": lacking})
    refused = _run(moved, "--checkpoint-dir", "ckpt", "--resume", "latest")
    assert refused.returncode != 0
    (line,) = [ln for ln in refused.stderr.splitlines() if "E-CHOICE-001" in ln]
    assert f"'{lacking}' for cpu.capability" in line and "--choices fresh" in line
    assert "Traceback" not in refused.stderr
    assert step_dirs(moved / "ckpt") == [FOUR]

    fresh = _run(moved, "--checkpoint-dir", "ckpt", "--resume", "latest", "--choices", "fresh")
    assert fresh.returncode == 0, fresh.stderr
    taken = _choices(moved / "ckpt" / LAST)["cpu.capability"]
    assert f"choice cpu.capability {lacking} -> {taken}" in _resumed_lines(moved)


def test_another_torch_is_refused_with_e_choice_001(moved):
    _forge(moved / "ckpt" / FOUR, **{"torch.version": "1.0.0"})
    refused = _run(moved, "--checkpoint-dir", "ckpt", "--resume", "latest")
    assert refused.returncode != 0
    assert "E-CHOICE-001" in refused.stderr and "'1.0.0' for torch.version" in refused.stderr
    assert step_dirs(moved / "ckpt") == [FOUR]


def test_threads_are_recorded_shown_and_pinned_against_threads(tmp_path):
    (tmp_path / "lm.sx").write_text(MODEL)
    done = _run(tmp_path, "--checkpoint-dir", "ckpt", "--threads", "2", "--steps", "4")
    assert done.returncode == 0, done.stderr
    assert _choices(tmp_path / "ckpt" / FOUR)["cpu.threads"] == "2"
    shown = run_sexpgpu("checkpoint", f"ckpt/{FOUR}", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    choices = shown.stdout.split("\nchoices\n", 1)[1].split("\nloaded", 1)[0]
    names = [line.split()[0] for line in choices.splitlines()]
    assert {"cpu.threads", "cpu.capability", "cpu.blas", "torch.version"} <= set(names)
    assert ["cpu.threads", "2"] in [line.split() for line in choices.splitlines()]

    asked = _run(tmp_path, "--checkpoint-dir", "ckpt", "--resume", "latest", "--threads", "1")
    assert asked.returncode != 0
    assert "E-CHOICE-001" in asked.stderr and "--threads 1" in asked.stderr


def _default_threads(
    folder: Path, *, affinity: set[int] | None, model: str = MODEL, **env: str
) -> str:
    folder.mkdir()
    (folder / "lm.sx").write_text(model)
    unset = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    environment = {k: v for k, v in sexpgpu_env(**env).items() if k not in unset}
    environment.update(env)
    done = subprocess.run(
        [
            *SEXPGPU,
            "run",
            "lm.sx",
            "--steps",
            "4",
            "--checkpoint-dir",
            "ckpt",
            "--metrics-dir",
            "m",
        ],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=(lambda: os.sched_setaffinity(0, affinity)) if affinity else None,
    )
    assert done.returncode == 0, done.stderr
    return _choices(folder / "ckpt" / FOUR)["cpu.threads"]


# Four times the width: some 630 million multiply-adds a step, two threads' worth.
WIDE = MODEL.replace("(gpt 16 16 32 4 2)", "(gpt 16 16 128 4 2)")


def test_a_new_run_takes_threads_by_its_work_and_the_cores_it_may_use(tmp_path):
    from sexpgpu_torch.threads import usable_cores

    assert _default_threads(tmp_path / "small", affinity=None) == "1"
    assert _default_threads(tmp_path / "wide", affinity=None, model=WIDE) == str(
        min(2, usable_cores())
    )
    one = {min(os.sched_getaffinity(0))}
    assert _default_threads(tmp_path / "one", affinity=one, model=WIDE) == "1"
    # the user's OpenMP count wins
    assert _default_threads(tmp_path / "omp", affinity=None, OMP_NUM_THREADS="2") == "2"
