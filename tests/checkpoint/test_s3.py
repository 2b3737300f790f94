"""Checkpoints in a bucket (moto's S3 server on loopback): write, find, load,
describe by ranged reads, and the spec's bucket snippet."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sexpgpu import checkpoint as ckpt
from sexpgpu_cli.commands.checkpoint import render_checkpoint
from tests.catalogs import open_location
from tests.profiles import suite_env

from .helpers import write
from .test_cli import CountingStorage

DOCS = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"

pytestmark = pytest.mark.slow


def test_a_checkpoint_in_a_bucket(s3_bucket, program):
    location = f"s3://{s3_bucket}/runs/my-run"
    storage = open_location(location)
    _, params, states, state, experiment = write(storage, program, 2)
    _, params, states, state, experiment = write(storage, program, 4, seed=1)
    storage.delete("step-00000004/experiment.json")  # cut off: passed over
    assert ckpt.find_latest(storage) == "step-00000002"
    _, params, states, state, experiment = write(storage, program, 4, seed=1)
    assert ckpt.find_latest(storage) == "step-00000004"

    found, key = ckpt.resolve_resume(f"{location}/step-00000004", None, open_location)
    loaded = ckpt.load_checkpoint(found, key)
    assert loaded.location == f"{location}/step-00000004"
    stored = {k: v for k, v in loaded.experiment.items() if k not in ("files", "written")}
    assert (stored, loaded.state) == (experiment, state)
    assert all(loaded.params[n].tobytes() == a.tobytes() for n, a in params.items())
    assert all(loaded.states[n].tobytes() == a.tobytes() for n, a in states.items())

    # Describing reads the two headers and never the tensor data.
    counting = CountingStorage(storage)
    text = render_checkpoint(ckpt.describe_checkpoint(counting, key))
    assert text.startswith(f"checkpoint {location}/step-00000004\nstep       4\n")
    tensor_bytes = sum(n for k, _, n in counting.reads if k.endswith(".safetensors"))
    assert tensor_bytes < 1024 < sum(a.nbytes for a in params.values())

    done = subprocess.run(
        [str(Path(sys.executable).parent / "sexpgpu"), "checkpoint", f"{location}/step-00000004"],
        capture_output=True,
        text=True,
        env=suite_env(),
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")
    unverified = (
        "data       not verified: headers only (--verify reads every file and checks its CRC32C)\n"
    )
    assert done.stdout == text + unverified


def test_the_bucket_snippet_runs_as_documented(s3_bucket, program):
    storage = open_location(f"s3://{s3_bucket}/runs/my-run")
    _, params, *_ = write(storage, program, 4)
    snippet = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)[1]
    # Only the bucket's name differs from the documented one.
    code = snippet.replace('"my-bucket"', repr(s3_bucket))
    scope: dict = {}
    exec(compile(code, "docs/checkpoints.md", "exec"), scope)
    assert sorted(scope["params"]) == sorted(params)
    assert all(scope["params"][n].tobytes() == a.tobytes() for n, a in params.items())
