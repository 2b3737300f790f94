"""The shipped examples compiled by the real compiler and trained by the torch lowering
with the real data sources; plus the lowering on CUDA where there is one."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sexpgpu.choices import LOWERING_CHOICE, Choices
from sexpgpu.extension import Supplies
from sexpgpu.lang.schedule import lr_at
from sexpgpu_torch.cpu_environment import CAPABILITY, THREADS, TORCH_VERSION, is_cpu_choice
from tests.catalogs import compile_file, lower, open_loader, project

REPO = Path(__file__).resolve().parents[2]
# GPT-2 small is a GPU example (a CPU step takes minutes): tests/compiled checks it
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.sx") if p.name != "gpt2-small.sx")


def _setup(path: Path, device: str = "cpu", pinned=None):
    program = compile_file(str(path))
    trainer = lower(program, device=device, recorded=pinned)
    loader = open_loader(program.stages[0].data, program.run.seed)
    return program, trainer, loader


def _records(trainer, generator, batch, seed: int, draw: tuple) -> dict:
    """The batch itself, or the records its stage's or pass's generator makes from it."""
    if generator is None:
        return batch
    return trainer.generate(generator, batch, seed=seed, draw=draw, stopping=lambda: False)


def _steps(program, trainer, loader, n: int) -> list[float]:
    stage = program.stages[0]
    losses = []
    for step in range(1, n + 1):
        batch = _records(
            trainer, stage.generator, loader.next_batch(), program.run.seed, ("step", step)
        )
        proposal = trainer.propose(
            batch, stage=0, step=step, lr=lr_at(stage.optimizer, step, stage.steps)
        )
        assert trainer.find_non_finite(proposal) is None
        trainer.commit(proposal)
        losses.append(proposal.loss)
    return losses


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_trains_on_the_cpu(path: Path) -> None:
    program, trainer, loader = _setup(path)
    kernels = {n for n in trainer.choices if not is_cpu_choice(n) and n != LOWERING_CHOICE}
    assert kernels == {s.name for s in program.sites}
    # and what decides the CPU's summation order, recorded beside them
    assert {THREADS, CAPABILITY, TORCH_VERSION} <= set(trainer.choices)
    trainer.init_params()
    losses = _steps(program, trainer, loader, 4)
    assert all(math.isfinite(x) for x in losses)
    params, states = trainer.export()
    # a frozen :load parameter (distill.sx's teacher) is named by a checkpoint, not copied
    kept = [p for p in program.params if p.trainable or p.load is None]
    assert set(params) == {p.path for p in kept}
    for p in kept:
        assert params[p.path].shape == tuple(p.type.shape)
    opts = project().available("sexpgpu_optimizers")
    info = next(o for o in opts if o.name == program.stages[0].optimizer.name)
    names = info.state_names({**info.options, **program.stages[0].optimizer.options})
    assert set(states) == {f"{p.path}/{n}" for p in program.params if p.trainable for n in names}
    for ev in program.evals:
        batch = open_loader(ev.data, program.run.seed + 1).next_batch()
        records = _records(trainer, ev.generator, batch, program.run.seed + 1, ("batch", 0))
        metrics = trainer.evaluate(ev.name, records)
        assert list(metrics) == list(ev.metrics)
        assert all(math.isfinite(v) for v in metrics.values())


def test_tiny_lm_reruns_are_bit_identical() -> None:
    path = REPO / "examples" / "tiny-lm.sx"
    exports = []
    for _ in range(2):
        program, trainer, loader = _setup(path)
        trainer.init_params()
        _steps(program, trainer, loader, 3)
        exports.append(trainer.export())
    for a, b in zip(exports[0], exports[1], strict=True):
        assert a.keys() == b.keys()
        assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = (
        "import sys, sexpgpu_torch\n"
        "infos = sexpgpu_torch.sexpgpu_optimizers() + sexpgpu_torch.sexpgpu_kernels()\n"
        "infos += sexpgpu_torch.sexpgpu_lowerings()\n"
        "assert [o.state_names(o.options) for o in sexpgpu_torch.sexpgpu_optimizers()]\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_init_matches_cpu_and_training_is_deterministic() -> None:
    path = REPO / "examples" / "tiny-lm.sx"
    program, cpu_trainer, _ = _setup(path)
    cpu_trainer.init_params()
    runs = []
    for _ in range(2):
        program, trainer, loader = _setup(path, device="cuda")
        trainer.init_params()
        if not runs:
            cpu_params = cpu_trainer.export()[0]
            gpu_params = trainer.export()[0]
            assert all(cpu_params[k].tobytes() == gpu_params[k].tobytes() for k in cpu_params)
        _steps(program, trainer, loader, 3)
        runs.append(trainer.export())
    for a, b in zip(runs[0], runs[1], strict=True):
        assert all(a[k].tobytes() == b[k].tobytes() for k in a)


@cuda
def test_cuda_bf16_precision_uses_autocast_and_stays_finite() -> None:
    text = (
        (REPO / "examples" / "tiny-lm.sx").read_text().replace(":seed 1", ":seed 1 :precision bf16")
    )
    from tests.catalogs import compile_text

    program = compile_text(text, str(REPO / "examples" / "tiny-lm-bf16.sx"))
    assert program.run.precision == "bf16"
    plugins = project()
    trainer = next(i for i in plugins.lowerings() if i.name == "torch")
    trainer = trainer.factory().lower(
        program,
        device="cuda",
        supplies=Supplies(kernels=plugins.kernels(), optimizers=plugins.optimizers()),
        choices=Choices(),
    )
    assert trainer.autocast
    trainer.init_params()
    stage = program.stages[0]
    rng = np.random.default_rng(0)
    batch = {
        name: rng.integers(0, 16, t.shape).astype(np.int64) for name, t in stage.data.fields.items()
    }
    proposal = trainer.propose(batch, stage=0, step=1, lr=1e-3)
    assert trainer.find_non_finite(proposal) is None
    assert math.isfinite(proposal.loss)
