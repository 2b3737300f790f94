"""Every example's graphs, under the compiled lowering, compile once: never again in a
later step, after an eval pass or in a resumed run (issue 23's rule; docs/cuda.md).

Whether a graph compiles again is dynamo's decision: its guards, made when it
traces. The backend only turns a traced graph into code. So this runs each example
in this process (``sexpgpu.train.run``, as ``sexpgpu run`` does) with the compiled
lowering's backend swapped for torch's ``aot_eager`` (dynamo and AOTAutograd, as
inductor gets them, without inductor's C++), which traces and guards every graph
as inductor would and costs seconds instead of a cold compile per example. A
later compile is caught by the lowering's own watch (``sexpgpu_torch.recompiles``),
which says it in the log. The sizes are made small with the examples' own knobs;
the graphs are the same graphs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch
from safetensors.numpy import save_file

import sexpgpu_torch.compiled
from sexpgpu.log import get_logger
from sexpgpu.session import Selection, Target
from sexpgpu.train import RunOptions, run
from sexpgpu_torch.recompiles import RECOMPILED
from tests.catalogs import project
from tests.e2e.helpers import EXAMPLES

# (file, knobs, steps of the first run, the step a second run resumes from, its last
# step; None: the file's own): each first run passes an eval pass where the example has one and ends with a
# checkpoint; each resume, in a new folder, runs past an eval pass again
CASES = [
    ("my-run.sx", {}, 2, 2, 4),
    ("tiny-lm.sx", {"dim": "16", "layers": "2", "checkpoint-every": "25"}, 50, 25, 50),
    ("cnn.sx", {"width": "4"}, 50, 50, 100),
    ("distill-teacher.sx", {}, 2, 2, 4),
    ("distill.sx", {}, 2, 2, 4),
    (
        "gpt2-small.sx",
        {"layers": "2", "heads": "2", "dim": "16", "context": "16", "batch": "2"},
        2,
        2,
        4,
    ),
    # generators: the key/value cache's prefill and step, and the eval pass's
    # (rl-sort has no steps knob: both runs go to its end, 2 + 4 steps, past its pass
    # and checkpoint at 3 and 6)
    (
        "rl-sort.sx",
        {"dim": "16", "imitate": "2", "reinforce": "4", "group": "2", "every": "3"},
        None,
        3,
        None,
    ),
    ("onpolicy-distill.sx", {"new": "4", "steps": "20"}, 10, 10, 20),
]


@pytest.fixture
def traced_only(monkeypatch: pytest.MonkeyPatch):
    """The compiled lowering on ``aot_eager`` in this process, with dynamo's caches and
    torch's deterministic mode (which the CPU compiled lowering switches on) as they
    were before the test."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setattr(sexpgpu_torch.compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(deterministic)


def _folder(tmp_path: Path) -> Path:
    """A copy of the examples, with the teacher distill.sx reads (random values in the
    shapes its ``:with-loaded`` names: the graphs do not depend on the values)."""
    folder = tmp_path / "examples"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    rng = np.random.default_rng(0)
    save_file(
        {
            "model.embed": rng.normal(0, 0.02, (256, 32)).astype(np.float32),
            "model.head": rng.normal(0, 0.02, (32, 256)).astype(np.float32),
        },
        str(folder / "teacher.safetensors"),
    )
    return folder


@pytest.mark.usefixtures("traced_only")
@pytest.mark.parametrize(
    ("file", "knobs", "steps", "resume", "last"), CASES, ids=[c[0] for c in CASES]
)
def test_no_graph_of_an_example_compiles_again(tmp_path, file, knobs, steps, resume, last):
    folder = _folder(tmp_path)
    get_logger()  # configure structlog first, so capture_logs stays in force

    def train(step_count: int | None, checkpoints: str, resume_from: str | None):
        options = RunOptions(
            Selection(str(folder / file), sets=knobs, steps=step_count),
            Target(lowering="compiled"),
            metrics_dir=str(tmp_path / "m"),
            checkpoint_dir=str(tmp_path / checkpoints),
            resume=resume_from,
        )
        with structlog.testing.capture_logs() as logs:
            outcome = run(options, project())
        assert outcome.exit_code == 0, outcome.message
        return logs

    logs = train(steps, "first", None)
    step = f"step-{resume:08d}"
    shutil.copytree(tmp_path / "first" / step, tmp_path / "resumed" / step)
    logs += train(last, "resumed", "latest")
    end = f"step-{last:08d}" if last else max(p.name for p in (tmp_path / "first").glob("step-*"))
    assert (tmp_path / "resumed" / end).is_dir()
    assert [e for e in logs if e["event"] == RECOMPILED] == []
    # both runs compiled (a warm-up took its seconds), on the compiled lowering
    started = [e for e in logs if e["event"] in ("run started", "run resumed")]
    assert [e["event"] for e in started] == ["run started", "run resumed"]
    for event in started:
        assert event["choices"]["lowering"] == "compiled" and "compile_seconds" in event
