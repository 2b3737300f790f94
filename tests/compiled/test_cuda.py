"""The compiled lowering on a GPU: bf16 training, recorded CUDA choices, a bit-exact
resume, and the pinned checkpoint snapshot. Skipped where torch sees no CUDA device
(benchmarks/gpu_check.sh runs them on one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)"
    ),
    pytest.mark.slow,
]

from safetensors.numpy import load_file  # noqa: E402

from tests.compiled.test_compiled_runs import PROGRAM  # noqa: E402
from tests.e2e.helpers import run_sexpgpu  # noqa: E402

BF16 = PROGRAM.replace(":guard-finite true", ":guard-finite true :precision bf16")
THREE, SIX = "step-00000003", "step-00000006"


def _tensors(step: Path) -> dict[str, np.ndarray]:
    return {
        **load_file(str(step / "params.safetensors")),
        **load_file(str(step / "states.safetensors")),
    }


def test_bf16_training_on_cuda_resumes_to_the_bit(tmp_path: Path, compiled_env) -> None:
    (tmp_path / "lm.sx").write_text(BF16)

    def run(name: str, *args: str):
        done = run_sexpgpu(
            "run", "lm.sx", "--device", "cuda", "--checkpoint-dir", name, *args,
            cwd=tmp_path, env=compiled_env, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run("full")
    shutil.copytree(tmp_path / "full" / THREE, tmp_path / "part" / THREE)
    run("part", "--resume", "latest")
    full, part = _tensors(tmp_path / "full" / SIX), _tensors(tmp_path / "part" / SIX)
    assert all(full[k].tobytes() == part[k].tobytes() for k in full)
    assert all(a.dtype == np.float32 for a in full.values())  # bf16 compute, f32 stored
    choices = json.loads((tmp_path / "full" / SIX / "experiment.json").read_text())["choices"]
    assert choices["lowering"] == "compiled"  # the default on CUDA
    assert choices["cuda.tf32"] == "off"  # a deterministic run
    assert choices["cuda.device"].startswith(torch.cuda.get_device_name())
    major, _ = torch.cuda.get_device_capability()
    assert choices["attention:model.blocks.attn"] == ("flash" if major >= 8 else "sdpa-math")


def test_a_snapshot_copies_into_pinned_reused_buffers() -> None:
    from sexpgpu.checkpoint import layout_tensors
    from sexpgpu_torch.cuda import PinnedSnapshots

    tensors = {
        "a": torch.randn(64, 32, device="cuda"),
        "b": torch.randn(7, device="cuda").to(torch.bfloat16),
    }
    arrays = layout_tensors({name: (tuple(t.shape), "float32") for name, t in tensors.items()})
    snapshots = PinnedSnapshots(torch.device("cuda"))
    for _ in range(2):  # the second copy reuses the registered buffer
        snapshots.copy(arrays, tensors)
        assert torch.from_numpy(arrays["a"]).is_pinned()
        assert np.array_equal(arrays["a"], tensors["a"].cpu().numpy())
        assert np.array_equal(arrays["b"], tensors["b"].float().cpu().numpy())
    assert len(snapshots.registered) == 1
