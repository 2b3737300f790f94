"""What a resume refuses, pins, and allows-and-records (spec: Resume)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from tests.e2e.helpers import refused_in_process
from tests.foundation.pluginkit import make_plugin

from .helpers import events, experiments, run_sexpgpu, sexpgpu_env, step_dirs

RUN = ["run", "examples/my-run.sx", "--checkpoint-dir", "ckpt", "--metrics-dir", "m"]


def _resume_annotation(workdir: Path) -> list[str]:
    (run_dir,) = experiments(workdir / "m")
    texts = [e["text"] for e in events(run_dir) if e["kind"] == "annotation"]
    resumed = [t for t in texts if t.startswith("resumed from")]
    assert len(resumed) == 1
    return resumed[0].split("\n")


def test_edited_sources_and_knobs_are_allowed_and_recorded(workdir):
    first = run_sexpgpu(*RUN, cwd=workdir)
    assert first.returncode == 0, first.stderr
    source = workdir / "examples" / "my-run.sx"
    import hashlib

    old = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    source.write_text(source.read_text() + "; a comment added later\n")
    new = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    resumed = run_sexpgpu(
        *RUN, "--resume", "ckpt/step-00000004", "--set", "lr=0.25", "--steps", "6", cwd=workdir
    )
    assert resumed.returncode == 0, resumed.stderr
    lines = _resume_annotation(workdir)
    assert lines == [
        "resumed from ckpt/step-00000004",
        f"source my-run.sx {old} -> {new}",
        "knob lr 0.5 -> 0.25",
        "knob steps 4 -> 6",
    ]
    assert step_dirs(workdir / "ckpt")[-1] == "step-00000006"


def test_a_changed_parameter_is_refused_and_nothing_is_written(workdir):
    first = run_sexpgpu(*RUN, cwd=workdir)
    assert first.returncode == 0, first.stderr
    source = workdir / "examples" / "my-run.sx"
    source.write_text(
        source.read_text()
        .replace("(net 32 8)", "(net 32 16)")
        .replace(
            "(param noise [vocab] :init (uniform -1 1) :frozen true)",
            "(param noise [vocab] :init (uniform -1 1))",
        )
    )
    before = sorted(os.listdir(workdir / "ckpt"))
    result = refused_in_process(*RUN, "--resume", "latest", "--steps", "6", cwd=workdir)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "model.embed" in result.stderr and "model.head" in result.stderr
    assert "model.noise" in result.stderr
    assert sorted(os.listdir(workdir / "ckpt")) == before


def test_another_device_count_is_refused_with_e_dp_002(workdir):
    first = run_sexpgpu(*RUN, cwd=workdir)
    assert first.returncode == 0, first.stderr
    path = workdir / "ckpt" / "step-00000004" / "experiment.json"
    record = json.loads(path.read_text())
    record["devices"] = 2
    path.write_text(json.dumps(record))
    result = refused_in_process(*RUN, "--resume", "latest", "--steps", "6", cwd=workdir)
    assert result.returncode == 1
    assert "E-DP-002" in result.stderr
    assert step_dirs(workdir / "ckpt") == ["step-00000002", "step-00000004"]


KERNEL_PLUGIN = '''
"""A throwaway third-party attention kernel."""
from sexpgpu.extension import KernelInfo
from sexpgpu.hookspecs import hookimpl


def _attention():
    import math

    import torch

    def attend(q, k, v, *, heads, causal):
        b, t, d = q.shape
        h = d // heads
        q, k, v = (x.reshape(b, t, heads, h).transpose(1, 2) for x in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h)
        if causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return out.transpose(1, 2).reshape(b, t, d)

    return attend


@hookimpl
def sexpgpu_kernels():
    return [KernelInfo(kind="attention", name="thirdparty-attn", lowering="torch",
                       devices=("cpu",), deterministic=True, factory=_attention, priority=100)]
'''


def _kernel_plugin(root: Path) -> Path:
    return make_plugin(
        root / "site",
        "thirdparty-attn",
        {"thirdparty_attn": KERNEL_PLUGIN},
        {"thirdparty-attn": "thirdparty_attn"},
    )


def test_a_recorded_choice_is_pinned_and_refused_when_it_cannot_be_taken(workdir):
    site = _kernel_plugin(workdir)
    with_plugin = sexpgpu_env(PYTHONPATH=str(site))
    tiny = [
        "run",
        "examples/tiny-lm.sx",
        "--steps",
        "2",
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
    ]
    first = run_sexpgpu(*tiny, env=with_plugin, cwd=workdir)
    assert first.returncode == 0, first.stderr
    recorded = json.loads((workdir / "ckpt" / "step-00000002" / "experiment.json").read_text())
    assert recorded["choices"]["attention:model.blocks.attn"] == "thirdparty-attn"

    # The plugin is gone: the recorded choice cannot be taken here.
    refused = run_sexpgpu(*tiny[:3], "4", *tiny[4:], "--resume", "latest", cwd=workdir)
    assert refused.returncode == 1
    assert "E-CHOICE-001" in refused.stderr and "thirdparty-attn" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert step_dirs(workdir / "ckpt") == ["step-00000002"]

    # --choices fresh chooses again, and the change is recorded.
    fresh = run_sexpgpu(
        *tiny[:3], "4", *tiny[4:], "--resume", "latest", "--choices", "fresh", cwd=workdir
    )
    assert fresh.returncode == 0, fresh.stderr
    lines = _resume_annotation(workdir)
    assert "choice attention:model.blocks.attn thirdparty-attn -> math" in lines
    final = json.loads((workdir / "ckpt" / "step-00000004" / "experiment.json").read_text())
    assert final["choices"]["attention:model.blocks.attn"] == "math"


def test_loading_one_elsewhere_runs_the_spec_snippet(workdir):
    result = run_sexpgpu(*RUN, cwd=workdir)
    assert result.returncode == 0, result.stderr
    step = workdir / "ckpt" / "step-00000004"
    snippet = textwrap.dedent(
        f'''
        import json
        from safetensors.numpy import load_file  # safetensors.torch.load_file for tensors

        step = "{step}"
        identity = json.load(open(f"{{step}}/experiment.json"))
        params = load_file(f"{{step}}/params.safetensors")   # {{"model.net.embed.table": array, ...}}
        states = load_file(f"{{step}}/states.safetensors")   # {{"model.net.embed.table/m": array, ...}}
        for declared in identity["params"]:
            if declared["path"] not in params:  # frozen and read from a file
                source = declared["load"]       # {{"uri", "tensor", "size", "version"}}
                continue
            assert list(params[declared["path"]].shape) == declared["shape"]
        print(sorted(params), sorted(states))
        '''
    )
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, check=True
    )
    assert "model.noise" in out.stdout and "model.embed/m" in out.stdout


def test_sexpgpu_checkpoint_describes_a_run_checkpoint(workdir):
    result = run_sexpgpu(*RUN, cwd=workdir)
    assert result.returncode == 0, result.stderr
    shown = run_sexpgpu("checkpoint", "ckpt/step-00000004", cwd=workdir)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[:8] == [
        "checkpoint ckpt/step-00000004",
        "step       4",
        "sexpgpu    0.1.0",
        "variant    -",
        "devices    1",
        "precision  f32",
        "seed       7",
        "counters   tokens",
    ]
    assert "params.safetensors  3 tensors" in lines
    assert any(line.split() == ["model.noise", "F32", "[32]", "frozen"] for line in lines)
