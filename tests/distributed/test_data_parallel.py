"""Data parallel through the real launcher: `sexpgpu run --devices N` and `torchrun`.

Every run here is `sexpgpu` (or `torchrun`) in a subprocess with gloo ranks on
the CPU, one thread each. One uninterrupted two-rank run is shared by the
module: the reference every stopped, killed and resumed run must match to the
byte.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.e2e.helpers import (
    assert_every_checkpoint_complete,
    assert_same_tensors,
    events,
    experiments,
    run_sexpgpu,
    sexpgpu_env,
    slow_writes_plugin,
    start_sexpgpu,
    status,
    step_dirs,
    wait_for_step,
)

from .kit import (
    SIGNALS,
    STEPS,
    TORCHRUN,
    ended,
    free_port,
    interrupted_lines,
    last,
    launch,
    project,
    run_args,
    start,
    torchrun,
    wait_until,
    worker_pid,
)


def losses(root) -> dict[int, float]:
    (run_dir,) = experiments(root / "m")
    return {e["step"]: e["value"] for e in events(run_dir) if e.get("name") == "loss"}


@pytest.mark.slow
def test_two_ranks_train_as_one_global_batch_and_record_it(reference, tmp_path):
    root = reference
    experiment = json.loads((last(root) / "experiment.json").read_text())
    assert (experiment["devices"], experiment["nodes"]) == (2, 1)
    assert experiment["finished"] is True
    # counters are the global batch's: 24 records of 16 tokens a step, whatever the ranks
    state = json.loads((last(root) / "state.json").read_text())
    assert state["counters"] == {"tokens": STEPS * 24 * 16, "records": STEPS * 24}
    assert_every_checkpoint_complete(root / "ckpt")
    # rank 0 alone reports: one loss point a step, one status file, one experiment
    (run_dir,) = experiments(root / "m")
    stream = events(run_dir)
    assert sorted(losses(root)) == list(range(1, STEPS + 1))
    assert [e["name"] for e in stream if e.get("name", "").startswith("probe/")] == [
        "probe/loss"
    ] * (STEPS // 40)
    assert status(run_dir)["state"] == "finished"
    shown = run_sexpgpu("checkpoint", str(last(root)), cwd=root)
    assert "devices    2\n" in shown.stdout, shown.stdout
    # the same global batch on one rank: the same losses, to float tolerance
    one = project(tmp_path / "one")
    result = launch(one, steps=STEPS)
    assert result.returncode == 0, result.stderr
    solo, pair = losses(one), losses(root)
    np.testing.assert_allclose(
        [pair[s] for s in sorted(pair)], [solo[s] for s in sorted(solo)], rtol=2e-3
    )
    assert json.loads((last(one) / "experiment.json").read_text())["devices"] == 1


@pytest.mark.slow
def test_three_ranks_under_torchrun_hold_the_same_bytes(tmp_path):
    root = project(tmp_path)
    result = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "3"]
        + ["rank_params.py", "dp.sx", "out", "7"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    files = [(root / "out" / f"rank-{rank}.safetensors").read_bytes() for rank in range(3)]
    assert files[0] == files[1] == files[2]
    tensors = load_file(str(root / "out" / "rank-0.safetensors"))
    # trained: the update moved every trainable parameter from its start
    assert any(name.startswith("states/") for name in tensors)


CASES = [
    ("SIGTERM", "launcher", True),
    ("SIGINT", "worker", False),
    ("SIGHUP", "worker", True),
    ("SIGTERM", "worker", False),
    ("SIGINT", "launcher", False),
    ("SIGHUP", "launcher", False),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "target", "resume"), CASES)
def test_a_signal_stops_every_rank_after_the_same_step(reference, tmp_path, name, target, resume):
    root = project(tmp_path)
    at = random.Random(f"{name}-{target}").randint(3, 30)
    proc = start(root, "--devices", "2", "--resume", "latest", steps=STEPS)
    wait_for_step(root / "m", at, proc)
    pid = proc.pid if target == "launcher" else worker_pid(proc, 1)
    os.kill(pid, SIGNALS[name])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + SIGNALS[name], err
    (line,) = interrupted_lines(err)
    n = int(line.rsplit(" ", 1)[1])
    assert n >= at
    (run_dir,) = experiments(root / "m")
    assert status(run_dir)["state"] == "interrupted"
    assert status(run_dir)["step"] == n
    assert f"interrupted by {name} at step {n}" in [e.get("text") for e in events(run_dir)]
    assert step_dirs(root / "ckpt")[-1] == f"step-{n:08d}"
    assert_every_checkpoint_complete(root / "ckpt")
    if not resume:
        return
    again = launch(root, "--devices", "2", "--resume", "latest", steps=STEPS)
    assert again.returncode == 0, again.stderr
    assert_same_tensors(last(root), last(reference))


@pytest.mark.slow
def test_a_second_sigterm_ends_the_launcher_and_every_worker_at_once(tmp_path):
    # The stop's checkpoint takes minutes to write, so only the second SIGTERM can
    # end the run within the bound: the orderly stop never finishes.
    root = project(tmp_path / "run")
    # the stop's checkpoint alone: a run past its step-20 checkpoint (a loaded machine
    # reads the events late) would wait for that slow write before it could stop
    program = root / "dp.sx"
    program.write_text(
        program.read_text().replace(":checkpoint-every 20", ":checkpoint-every 100000")
    )
    env = sexpgpu_env(PYTHONPATH=str(slow_writes_plugin(tmp_path)), SLOW_WRITE_SECONDS="300")
    target = f"slowwrite://{root / 'ckpt'}"
    args = run_args("--devices", "2", "--checkpoint-dir", target, steps=STEPS * 100)
    proc = start_sexpgpu(*args, cwd=root, env=env)
    wait_for_step(root / "m", 3, proc)
    workers = [worker_pid(proc, rank) for rank in range(2)]
    proc.send_signal(signal.SIGTERM)
    (run_dir,) = experiments(root / "m")
    # the first stop is under way (reported before its checkpoint is written)
    assert wait_until(
        lambda: "interrupted by SIGTERM" in run_dir.joinpath("events.jsonl").read_text()
    )
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    for pid in workers:
        assert wait_until(lambda pid=pid: ended(pid)), f"worker {pid} still runs"
    assert status(run_dir)["state"] == "running"  # the orderly stop's end never came
    written = root / "ckpt"
    assert not written.exists() or not list(written.glob("step-*/experiment.json"))


@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_from_its_newest_checkpoint(reference, tmp_path):
    root = project(tmp_path)
    # without restarts: the others fail with a clear line, the launcher names the dead one
    proc = start(root, "--devices", "2", "--resume", "latest", steps=STEPS)
    wait_for_step(root / "m", 5, proc)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err
    assert "sexpgpu run: rank 1 was killed by SIGKILL; the group stopped" in err.splitlines()
    # with restarts and --resume latest: the group continues to the reference's bytes
    proc = start(root, "--devices", "2", "--resume", "latest", "--max-restarts", "1", steps=STEPS)
    wait_for_step(root / "m", 40, proc)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert_same_tensors(last(root), last(reference))


@pytest.mark.slow
def test_two_nodes_record_their_count_and_one_node_may_not_resume(tmp_path):
    root = project(tmp_path)
    port = free_port()
    args = ["-m", "sexpgpu_cli", "run", "dp.sx", "--steps", "6"]
    args += ["--checkpoint-dir", "ckpt", "--metrics-dir", "m"]
    nodes = [torchrun(root, *args, nnodes=2, nproc=1, port=port) for _ in range(2)]
    results = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    experiment = json.loads((root / "ckpt" / "step-00000006" / "experiment.json").read_text())
    assert (experiment["devices"], experiment["nodes"]) == (2, 2)
    shown = run_sexpgpu("checkpoint", "ckpt/step-00000006", cwd=root)
    assert "devices    2 on 2 nodes\n" in shown.stdout, shown.stdout
    refused = launch(root, "--devices", "2", "--resume", "latest", steps=8)
    assert refused.returncode == 1, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("sexpgpu run:")]
    assert lines == [
        "sexpgpu run: E-DP-002: the checkpoint was written by 2 devices on 2 nodes and this "
        "run has 2 devices on 1 node; resume with the same device and node count"
    ]
    assert step_dirs(root / "ckpt")[-1] == "step-00000006"


@pytest.mark.slow
def test_the_finite_guard_stops_every_rank_with_one_line(tmp_path):
    root = project(tmp_path)
    bad = launch(root, "--devices", "2", "--set", "guard=true", "--set", "lr=1e39", steps=4)
    assert bad.returncode == 1, bad.stderr
    lines = [line for line in bad.stderr.splitlines() if line.startswith("sexpgpu run:")]
    assert len(lines) == 1, bad.stderr
    assert lines[0].startswith("sexpgpu run: step 1: the proposed ")
    assert lines[0].endswith("values that are not finite; nothing was committed")
    assert not (root / "ckpt").exists() or not step_dirs(root / "ckpt")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices (NCCL, one rank each)")
def test_two_cuda_ranks_train_with_nccl(tmp_path):
    root = project(tmp_path)
    result = launch(root, "--devices", "2", "--device", "cuda", steps=6)
    assert result.returncode == 0, result.stderr
    experiment = json.loads((root / "ckpt" / "step-00000006" / "experiment.json").read_text())
    assert (experiment["devices"], experiment["nodes"]) == (2, 1)
