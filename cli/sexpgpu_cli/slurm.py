"""A rank started by Slurm's ``srun``: torch's variables from Slurm's.

Under ``srun --ntasks N sexpgpu run ...`` every task is a plain ``sexpgpu run``,
as a ``torchrun`` worker is, but Slurm names its place with variables of its own.
:func:`take_srun_environment` sets torch's from them, so the run finds its rank
the one way it always does (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...). Only a
job step ``srun`` started with several tasks counts (``SLURM_STEP_NUM_TASKS``):
a batch script's own shell, which has ``SLURM_NTASKS`` too, stays one process.
Variables already set (by ``torchrun`` under ``srun``, or by the user) win.

The ranks meet at ``MASTER_ADDR:MASTER_PORT``: the user's when set, else the
address of the node that ran ``srun`` (``SLURM_LAUNCH_NODE_IPADDR``) and a port
derived from the job id, the same in every task, so two jobs sharing a node
rarely pick the same one.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

__all__ = ["take_srun_environment"]

_FROM_SLURM = {
    "RANK": "SLURM_PROCID",
    "WORLD_SIZE": "SLURM_STEP_NUM_TASKS",
    "LOCAL_RANK": "SLURM_LOCALID",
    "GROUP_WORLD_SIZE": "SLURM_STEP_NUM_NODES",
}
"""torch's variable: the Slurm variable it is read from."""

PORT_BASE = 29500
PORT_SPAN = 10000


def _tasks_on_this_node(environ: MutableMapping[str, str]) -> str | None:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 tasks on each of 3 nodes, then 1)
    read for this node, ``SLURM_NODEID``; ``None`` when it cannot be read."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    try:
        node = int(environ.get("SLURM_NODEID", "0"))
    except ValueError:
        return None
    for part in spec.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            return None
        count, repeat = found.group(1), int(found.group(2) or 1)
        if node < repeat:
            return count
        node -= repeat
    return None


def take_srun_environment(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set torch's rank variables from ``srun``'s, for a task of a step with several
    tasks; whether it did (see the module docstring)."""
    try:
        tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1"))
    except ValueError:
        return False
    if tasks <= 1 or "SLURM_PROCID" not in environ or "RANK" in environ:
        return False
    for name, slurm in _FROM_SLURM.items():
        if slurm in environ:
            environ.setdefault(name, environ[slurm])
    local = _tasks_on_this_node(environ)
    if local is not None:
        environ.setdefault("LOCAL_WORLD_SIZE", local)
    environ.setdefault("MASTER_ADDR", environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    job = environ.get("SLURM_JOB_ID", "0")
    port = PORT_BASE + (int(job) % PORT_SPAN if job.isdigit() else 0)
    environ.setdefault("MASTER_PORT", str(port))
    return True
