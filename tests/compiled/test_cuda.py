"""sexpgpu on a GPU, as a user runs it: bf16 training and its recorded CUDA choices, a
bit-exact resume from a copied checkpoint and after a SIGTERM at a random step, the
eager lowering (flash attention), a run that is not deterministic, a compiled bundle
replayed, a generator stopped while generating and resumed to the bit, and the
pinned checkpoint snapshot. Skipped where torch sees no CUDA device
(benchmarks/gpu_check.sh runs them on one; the suite never forks a `sexpgpu` from an
interpreter that touched CUDA: tests/preloaded.py)."""

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


# ---------------------------------------------------------------- on a GPU, as a user runs it

LONG = BF16.replace("(defknob steps 6)", "(defknob steps 40)").replace(
    ":checkpoint-every 3", ":checkpoint-every 1000"
)  # only the stop's checkpoint and the last


def _tensors_equal(a: Path, b: Path) -> list[str]:
    ta, tb = _tensors(a), _tensors(b)
    return sorted(k for k in ta if ta[k].tobytes() != tb[k].tobytes()) or (
        ["the tensor names differ"] if sorted(ta) != sorted(tb) else []
    )


def test_a_sigterm_at_a_random_step_of_a_bf16_compiled_run_resumes_to_the_bit(
    tmp_path: Path, compiled_env
) -> None:
    import os
    import random
    import signal

    from tests.e2e.helpers import start_sexpgpu, wait_for_step

    (tmp_path / "lm.sx").write_text(LONG)
    args = ("run", "lm.sx", "--device", "cuda", "--metrics-dir", "m")
    straight = run_sexpgpu(*args, "--checkpoint-dir", "straight", cwd=tmp_path, env=compiled_env,
                           timeout=600)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    proc = start_sexpgpu(*args, "--checkpoint-dir", "stopped", "--resume", "latest",
                         cwd=tmp_path, env=compiled_env)  # fmt: skip
    wait_for_step(tmp_path / "m", random.Random("cuda sigterm").randint(5, 30), proc, timeout=600)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    again = run_sexpgpu(*args, "--checkpoint-dir", "stopped", "--resume", "latest",
                        cwd=tmp_path, env=compiled_env, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    last = "step-00000040"
    assert _tensors_equal(tmp_path / "stopped" / last, tmp_path / "straight" / last) == []


def test_the_eager_lowering_on_cuda_takes_flash_and_resumes_to_the_bit(
    tmp_path: Path, compiled_env
) -> None:
    (tmp_path / "lm.sx").write_text(BF16)
    args = ("run", "lm.sx", "--device", "cuda", "--lowering", "torch")
    full = run_sexpgpu(*args, "--checkpoint-dir", "full", cwd=tmp_path, env=compiled_env)
    assert full.returncode == 0, full.stderr[-3000:]
    shutil.copytree(tmp_path / "full" / THREE, tmp_path / "part" / THREE)
    part = run_sexpgpu(*args, "--checkpoint-dir", "part", "--resume", "latest", cwd=tmp_path,
                       env=compiled_env)  # fmt: skip
    assert part.returncode == 0, part.stderr[-3000:]
    assert _tensors_equal(tmp_path / "full" / SIX, tmp_path / "part" / SIX) == []
    choices = json.loads((tmp_path / "full" / SIX / "experiment.json").read_text())["choices"]
    assert choices["lowering"] == "torch"
    major, _ = torch.cuda.get_device_capability()
    assert choices["attention:model.blocks.attn"] == ("flash" if major >= 8 else "math")


def test_a_non_deterministic_compiled_run_on_cuda_trains(tmp_path: Path, compiled_env) -> None:
    (tmp_path / "lm.sx").write_text(BF16.replace(":guard-finite true", ":deterministic false"))
    done = run_sexpgpu("run", "lm.sx", "--device", "cuda", "--checkpoint-dir", "ckpt",
                       cwd=tmp_path, env=compiled_env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    choices = json.loads((tmp_path / "ckpt" / SIX / "experiment.json").read_text())["choices"]
    assert choices["cuda.tf32"] == "on"  # a run that gives up bits takes TF32
    assert all(np.isfinite(v).all() for v in _tensors(tmp_path / "ckpt" / SIX).values())


def test_a_compiled_bundle_replays_on_cuda_to_the_bit(tmp_path: Path, compiled_env) -> None:
    from tests.e2e.helpers import sexpgpu_env

    (tmp_path / "lm.sx").write_text(BF16)
    made = run_sexpgpu("bundle", "lm.sx", "--device", "cuda", "--lowering", "compiled", "-o",
                       "lm.sxb", cwd=tmp_path, timeout=900)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    file_run = run_sexpgpu("run", "lm.sx", "--device", "cuda", "--checkpoint-dir", "file",
                           cwd=tmp_path, env=compiled_env, timeout=600)  # fmt: skip
    assert file_run.returncode == 0, file_run.stderr[-3000:]
    env = {k: v for k, v in sexpgpu_env().items() if not k.startswith("TORCHINDUCTOR_")}
    replay = run_sexpgpu("run", "lm.sxb", "--device", "cuda", "--checkpoint-dir", "replay",
                         cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert _tensors_equal(tmp_path / "file" / SIX, tmp_path / "replay" / SIX) == []


def test_a_generator_stopped_while_generating_on_cuda_resumes_to_the_bit(tmp_path: Path) -> None:
    """examples/rl-sort.sx's shape (imitate, then sample and reinforce), one block,
    its forward gated (tests/e2e/gating.py): the signal lands in a trip drawn at random."""
    import os
    import random
    import signal
    import subprocess
    import time

    from tests.e2e.gating import GATED_LM, make_gate_plugin
    from tests.foundation.pluginkit import sexpgpu_command, user_env

    program = (
        GATED_LM
        + """(defdata train (sort :vocab 8 :length 3) :seq 8 :batch 4)
(defdata prompts (sort :vocab 8 :length 3 :split "rl") :seq 8 :batch 4)
(defrun gated :model (lm 8 8 16) :optimizer (adam :lr 0.01) :seed 5 :checkpoint-every 3
  :precision bf16 :counters (tokens records generated)
  :stages ((stage imitate :steps 2 :data train :loss (cross-entropy (model inputs) targets))
           (stage reinforce :steps 5 :data prompts
            :generate (sample model :new-tokens 4 :samples 2 :temperature 1.0)
            :loss (let [seq (sum (* (gather (log-softmax (model sequence)) next) next-mask) :axis 1)
                        adv (- reward (group-mean reward :size 2))]
                    (neg (mean (* adv seq)))))))
"""
    )
    plugins = make_gate_plugin(tmp_path / "plugins")

    def site(name: str) -> Path:
        root = tmp_path / name
        (root / "gate" / "rank-0").mkdir(parents=True)
        (root / "gated.sx").write_text(program)
        return root

    def start(root: Path, *args: str, at: int = 0) -> subprocess.Popen:
        return subprocess.Popen(
            [*sexpgpu_command(), "run", "gated.sx", "--device", "cuda", "--metrics-dir", "m",
             "--checkpoint-dir", "ckpt", *args],
            cwd=root, env=user_env([plugins], GATE_DIR=str(root / "gate"), GATE_AT=str(at)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    whole = site("whole")
    proc = start(whole)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    stopped = site("stopped")
    at = random.Random("cuda generator").randint(1, 5 * 4 - 2)  # a trip before the last
    proc = start(stopped, at=at)
    gate = stopped / "gate" / "rank-0"
    while not (gate / f"trip-{at}").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)
    (gate / "release").touch()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert (
        "while generating"
        in (stopped / "m")
        .joinpath(next(p.name for p in (stopped / "m").iterdir()), "events.jsonl")
        .read_text()
    )
    shutil.rmtree(stopped / "gate")
    (stopped / "gate" / "rank-0").mkdir(parents=True)
    proc = start(stopped, "--resume", "latest")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    last = "step-00000007"
    assert _tensors_equal(stopped / "ckpt" / last, whole / "ckpt" / last) == []
