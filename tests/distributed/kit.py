"""Helpers for the data-parallel tests: the launcher, its workers, and tiny runs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.helpers import events, experiments, run_sexpgpu, sexpgpu_env, start_sexpgpu

HERE = Path(__file__).resolve().parent
DEVICE = os.environ.get("SEXPGPU_DP_TEST_DEVICE", "cpu")
"""cpu here; ``gpu_check.sh`` runs the same tests with ``cuda`` (NCCL)."""
PROGRAM = "dp.sx"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


STEPS = 300
"""Long enough for a signal to land mid-run, a few seconds on two ranks."""


def last(root: Path) -> Path:
    """The last checkpoint of a run of STEPS steps in ``root``."""
    return root / "ckpt" / f"step-{STEPS:08d}"


def project(root: Path, program: str = PROGRAM) -> Path:
    """``root`` holding a copy of a tests' program, as a user's folder would."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / program, root / program)
    shutil.copy(HERE / "rank_params.py", root / "rank_params.py")
    return root


def run_args(*extra: str, steps: int, program: str = PROGRAM) -> list[str]:
    return [
        "run",
        program,
        "--steps",
        str(steps),
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
        "--device",
        DEVICE,
        *extra,
    ]


def launch(root: Path, *extra: str, steps: int, timeout: float = 240, program: str = PROGRAM):
    """``sexpgpu run dp.sx ...`` (or ``program``) to its end; the CompletedProcess."""
    return run_sexpgpu(*run_args(*extra, steps=steps, program=program), cwd=root, timeout=timeout)


def start(root: Path, *extra: str, steps: int, program: str = PROGRAM) -> subprocess.Popen:
    """``sexpgpu run dp.sx ...`` (or ``program``) in the background."""
    return start_sexpgpu(*run_args(*extra, steps=steps, program=program), cwd=root)


def worker_pid(launcher: subprocess.Popen, rank: int, timeout: float = 120) -> int:
    """The pid of a launcher's worker, from the pid file it leaves in the launch folder."""
    deadline = time.monotonic() + timeout
    pattern = f"sexpgpu-launch-{launcher.pid}-*/rank-{rank}.pid"
    while time.monotonic() < deadline:
        for path in Path(tempfile.gettempdir()).glob(pattern):
            text = path.read_text()
            if text:
                return int(text)
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} for launcher {launcher.pid}")


def ended(pid: int) -> bool:
    """Whether a process is gone (or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(condition, timeout: float = 60) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (a bound, not a measure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(root: Path, *args: str, nnodes: int, nproc: int, port: int) -> subprocess.Popen:
    """One machine's ``torchrun`` joining a c10d rendezvous on 127.0.0.1:``port``."""
    return subprocess.Popen(
        [
            *TORCHRUN,
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "sexpgpu-test",
            "--local-addr",
            "127.0.0.1",
            *args,
        ],
        cwd=root,
        env=sexpgpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def interrupted_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("sexpgpu run: interrupted by")]


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}


def last_pass_and_evaluate(
    reference: Path, copy: Path, metric: str, steps: int = STEPS
) -> tuple[float, list[float]]:
    """The last in-run value of ``metric`` in a copy of a ``steps``-step run with a pass
    every 40 steps, and what ``sexpgpu evaluate`` gives on the checkpoint it evaluated,
    in one process (a copy: evaluating reports into the run's experiment)."""
    shutil.copytree(reference, copy)
    (run_dir,) = experiments(copy / "m")
    in_run = [e["value"] for e in events(run_dir) if e.get("name") == metric]
    assert len(in_run) == steps // 40
    checkpoint = copy / "ckpt" / f"step-{steps // 40 * 40:08d}"
    result = run_sexpgpu("evaluate", str(checkpoint), "--metrics-dir", "m", cwd=copy)
    assert result.returncode == 0, result.stderr
    again = [
        e["value"]
        for e in events(run_dir)
        if e.get("name") == metric and e.get("source") == "evaluate"
    ]
    return in_run[-1], again
