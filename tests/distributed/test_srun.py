"""Ranks that Slurm's ``srun`` started: its variables read as torch's.

No Slurm here: the tests set the variables ``srun`` gives each task, as it would,
and start the tasks themselves.
"""

from __future__ import annotations

import pytest

from sexpgpu_cli.slurm import take_srun_environment
from tests.e2e.helpers import assert_same_tensors, sexpgpu_env, start_sexpgpu

from .kit import free_port, project, run_args

STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
}
"""What srun gives every task of a 4-task step on 2 nodes."""


def task(procid: int, nodeid: int, localid: int, **extra: str) -> dict[str, str]:
    return {
        **STEP,
        "SLURM_PROCID": str(procid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_LOCALID": str(localid),
        **extra,
    }


def test_a_task_of_a_step_finds_its_rank_and_the_meeting_point():
    environ = task(3, 1, 1)
    assert take_srun_environment(environ)
    assert {k: environ[k] for k in environ if not k.startswith("SLURM_")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": str(29500 + 4242),
    }


@pytest.mark.parametrize(
    ("tasks_per_node", "node", "local"),
    [("3,1", 0, "3"), ("3,1", 1, "1"), ("2(x3),1", 2, "2"), ("2(x3),1", 3, "1"), ("bad", 0, None)],
)
def test_the_tasks_on_this_node_are_read_from_the_step(tasks_per_node, node, local):
    environ = task(0, node, 0, SLURM_STEP_TASKS_PER_NODE=tasks_per_node)
    assert take_srun_environment(environ)
    assert environ.get("LOCAL_WORLD_SIZE") == local


def test_what_the_user_or_torchrun_set_wins():
    environ = task(1, 0, 1, MASTER_ADDR="node0", MASTER_PORT="1234")
    assert take_srun_environment(environ)
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("node0", "1234")
    under_torchrun = task(1, 0, 1, RANK="5", WORLD_SIZE="8")
    assert not take_srun_environment(under_torchrun)
    assert (under_torchrun["RANK"], under_torchrun["WORLD_SIZE"]) == ("5", "8")


def test_a_batch_script_or_a_one_task_step_stays_one_process():
    batch_shell = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    assert not take_srun_environment(batch_shell)
    assert "RANK" not in batch_shell
    one = task(0, 0, 0, SLURM_STEP_NUM_TASKS="1")
    assert not take_srun_environment(one)
    assert "RANK" not in one


@pytest.mark.slow
def test_two_srun_tasks_train_as_two_ranks_do(reference, tmp_path):
    root = project(tmp_path)
    port = str(free_port())  # set as a user may; the port from the job id is tested above
    procs = []
    for rank in range(2):
        env = sexpgpu_env(
            SLURM_JOB_ID="77",
            MASTER_PORT=port,
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_NUM_NODES="1",
            SLURM_STEP_TASKS_PER_NODE="2",
            SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
            SLURM_PROCID=str(rank),
            SLURM_NODEID="0",
            SLURM_LOCALID=str(rank),
        )
        procs.append(start_sexpgpu(*run_args(steps=20), cwd=root, env=env))
    results = [proc.communicate(timeout=240) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    checkpoint = root / "ckpt" / "step-00000020"
    assert '"devices": 2' in (checkpoint / "experiment.json").read_text()
    assert_same_tensors(checkpoint, reference / "ckpt" / "step-00000020")
