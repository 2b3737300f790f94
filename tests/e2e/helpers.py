"""Helpers for end-to-end tests: `sexpgpu` in a subprocess, its metrics and checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.profiles import suite_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SEXPGPU = [sys.executable, "-c", "from sexpgpu_cli.main import main; main()"]


def sexpgpu_env(**extra: str) -> dict[str, str]:
    env = suite_env()
    env.update({"SEXPGPU_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_sexpgpu(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    """Run `sexpgpu ARGS` to the end; returns the CompletedProcess."""
    return subprocess.run(
        [*SEXPGPU, *map(str, args)],
        cwd=cwd,
        env=env or sexpgpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sexpgpu_in_process(*args: object, cwd: Path, env: dict[str, str] | None = None):
    """`sexpgpu ARGS` for a command that trains nothing (``check``, ``checkpoint``,
    ``runs``, ``report``...), run in this process (tests/inprocess.py): what
    :func:`run_sexpgpu` returns, without a process's start-up."""
    from tests import inprocess

    return inprocess.sexpgpu(*args, cwd=cwd, env=env or sexpgpu_env())


def refused_in_process(
    *args: object, cwd: Path, env: dict[str, str] | None = None, timeout: float | None = None
):
    """`sexpgpu run ARGS` (or ``evaluate``) that the test expects refused before its
    program is lowered (a bad file, option or checkpoint), run in this process
    (tests/inprocess.py, :func:`~tests.inprocess.refused`): what :func:`run_sexpgpu`
    returns, without a process's start-up; one that gets as far as lowering fails
    the test instead of training in it (``timeout``: ignored, as a refusal is quick)."""
    from tests import inprocess

    return inprocess.refused(*args, cwd=cwd, env=env or sexpgpu_env())


def start_sexpgpu(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `sexpgpu ARGS` in the background (its own process group)."""
    return subprocess.Popen(
        [*SEXPGPU, *map(str, args)],
        cwd=cwd,
        env=env or sexpgpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def experiments(metrics_dir: Path) -> list[Path]:
    return sorted(p for p in metrics_dir.iterdir() if p.is_dir()) if metrics_dir.exists() else []


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    # a line the sink is still writing is not an event yet: only whole lines count
    whole = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def wait_for_step(
    metrics_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120
) -> int:
    """Wait until some experiment under ``metrics_dir`` reports a loss at ``step`` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in experiments(metrics_dir):
            seen = [
                e["step"]
                for e in events(run_dir)
                if e.get("kind") == "point" and e.get("name") == "loss"
            ]
            if seen and max(seen) >= step:
                return max(seen)
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(
                f"sexpgpu ended before step {step}: rc={proc.returncode}\n{out}\n{err}"
            )
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout}s")


def tensors(checkpoint: Path) -> dict[str, dict[str, bytes]]:
    """Every tensor's dtype, shape and raw bytes in a checkpoint's two tensor files."""
    from safetensors.numpy import load_file

    result = {}
    for name in ("params.safetensors", "states.safetensors"):
        arrays = load_file(str(checkpoint / name))
        result[name] = {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in arrays.items()}
    return result


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    for name in ta:
        assert sorted(ta[name]) == sorted(tb[name]), f"{name}: different tensors"
        for key in ta[name]:
            assert ta[name][key] == tb[name][key], f"{name}:{key} differs between {a} and {b}"


CHECKPOINT_FILES = ["experiment.json", "params.safetensors", "state.json", "states.safetensors"]
"""The spec's four files, sorted."""


def assert_every_checkpoint_complete(checkpoint_dir: Path) -> None:
    """Every ``step-<n>`` folder holds exactly the four files."""
    for name in step_dirs(checkpoint_dir):
        files = sorted(p.name for p in (checkpoint_dir / name).iterdir())
        assert files == CHECKPOINT_FILES, f"{name}: {files}"


def step_dirs(checkpoint_dir: Path) -> list[str]:
    return sorted(p.name for p in checkpoint_dir.iterdir() if p.name.startswith("step-"))


def send(proc: subprocess.Popen, signum: int) -> None:
    os.kill(proc.pid, signum)


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}


def keep_file(workdir: Path, keep: str = "", every: int = 2) -> str:
    """examples/my-run.sx (copied into ``workdir/examples``) rewritten as ``keep.sx``
    with ``:checkpoint-every every`` and, if given, ``:keep-last keep``."""
    source = (workdir / "examples" / "my-run.sx").read_text()
    assert "  :checkpoint-every 2\n" in source
    extra = f"  :keep-last {keep}\n" if keep else ""
    (workdir / "keep.sx").write_text(
        source.replace("  :checkpoint-every 2\n", f"  :checkpoint-every {every}\n{extra}")
    )
    return "keep.sx"


def reference_run(workdir: Path, source: str, steps: int) -> Path:
    """Run ``source`` uninterrupted for ``steps`` into ``workdir/ref``, the checkpoints
    an interrupted run of it must end byte-identical to; returns that folder."""
    result = run_sexpgpu(
        "run", source, "--steps", str(steps), "--checkpoint-dir", "ref", "--metrics-dir", "m0",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return workdir / "ref"


def deleting(by_step: dict[int, set[str]]) -> bool:
    """Whether a deletion is part way, from each step folder's file names: a folder
    older than the newest complete one that has lost experiment.json and still holds files."""
    complete = [n for n, files in by_step.items() if "experiment.json" in files]
    return bool(complete) and any(
        n < max(complete) and "experiment.json" not in files and files
        for n, files in by_step.items()
    )


SLOW_WRITES = '''
"""slowwrite://PATH: a local folder whose checkpoint files take long to write."""

import os
import time

from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.catalog import Catalog


class SlowWrites:
    def __init__(self, uri):
        self.inner = Catalog.load().open_location(uri.removeprefix("slowwrite://"))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write_many(self, items):
        if any(key.startswith("step-") for key in items):
            time.sleep(float(os.environ["SLOW_WRITE_SECONDS"]))
        self.inner.write_many(items)

    def write(self, key, data):
        if key.startswith("step-"):
            time.sleep(float(os.environ["SLOW_WRITE_SECONDS"]))
        self.inner.write(key, data)


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(schemes=("slowwrite",), factory=SlowWrites, doc="slow writes")]
'''


def slow_writes_plugin(tmp_path: Path) -> Path:
    """A throwaway plugin supplying ``slowwrite://PATH``, a local folder whose
    checkpoint files each take ``$SLOW_WRITE_SECONDS`` to write: a stop's
    checkpoint then lasts as long as a test needs. Put the returned folder on
    ``PYTHONPATH``."""
    from tests.foundation.pluginkit import make_plugin

    return make_plugin(
        tmp_path / "slow-writes-plugin",
        "sexpgpu-slow-writes",
        {"slow_writes": SLOW_WRITES},
        {"slowwrite": "slow_writes"},
    )
