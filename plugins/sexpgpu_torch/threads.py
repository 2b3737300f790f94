"""How many CPU threads a new run takes: from its work per step and the cores this
process may use.

torch's default is every core the process's affinity allows. A small program
loses to its own thread pool there: each op's work is split, and the split costs
more than it saves; beside a busy neighbour OpenMP's threads spin waiting for the
core the neighbour holds, and a step takes tens of times as long (the README's
example: 1.9 s at 1 thread, 32-74 s at torch's default beside one busy process on
2 cores). So a run that pins none and is told none (``--threads``,
``OMP_NUM_THREADS``) takes one thread per :data:`WORK_PER_THREAD` of its step's
multiply-adds, at most the cores it may use: its affinity, capped by a cgroup's CPU
quota (a container's ``--cpus``), which the affinity does not show.

The count is a recorded choice (``cpu.threads``): a resume takes the recorded one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from sexpgpu.lang.ir import Graph, Node, Program

WORK_PER_THREAD = 300e6
"""Multiply-adds of a training step per thread: below this a second thread costs more
than it saves (benchmarks/bench_thread_choice.py measured where it starts to pay)."""

TRAIN_FACTOR = 3
"""A training step's work against its forward's: the backward takes about twice it."""

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may run on: its affinity, capped by its cgroup's quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota(cgroup_root)
    return max(1, min(cores, quota) if quota else cores)


def cgroup_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The CPU quota of this process's cgroup in whole cores (rounded up), or ``None``
    when it has none: ``cpu.max`` (cgroup v2: ``"200000 100000"``, ``"max 100000"``),
    else ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (v1, ``-1`` for none)."""
    v1 = root / "cpu"
    places = ((root / "cpu.max", None), (v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us"))
    for quota_file, period_file in places:
        try:
            text = quota_file.read_text().split()
            if period_file is not None:
                text += period_file.read_text().split()
        except OSError:
            continue
        try:
            quota, period = float(text[0]), float(text[1])
        except (ValueError, IndexError):  # "max", or something unreadable: no quota
            return None
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    return None


def step_work(program: Program) -> float:
    """Multiply-adds of the program's heaviest training step (its stages' losses,
    forward and backward), from the shapes the compiler inferred."""
    return TRAIN_FACTOR * max((graph_work(stage.loss) for stage in program.stages), default=0.0)


def graph_work(graph: Graph) -> float:
    """Multiply-adds of one run of ``graph``: its products (matmul, attention,
    conv2d) in full, every other op one per value it makes."""
    return sum(_node_work(graph, node) for node in graph.nodes)


def _node_work(graph: Graph, node: Node) -> float:
    out = math.prod(node.type.shape)
    if node.op == "repeat":
        return node.attrs["count"] * graph_work(node.attrs["body"])
    if node.op == "matmul":
        return out * graph.nodes[node.args[0]].type.shape[-1]
    if node.op == "attention":  # scores and their sum over the keys: 2 x [T x S] per width
        keys = graph.nodes[node.args[1]].type.shape[-2]
        return 2.0 * out * keys
    if node.op == "conv2d":
        weight = graph.nodes[node.args[1]].type.shape
        return out * math.prod(weight[1:])
    return out


def _chosen(work: float, cores: int) -> int:
    return max(1, min(cores, int(work // WORK_PER_THREAD)))


def choose(program: Program, cores: int | None = None) -> int:
    """The thread count a new run of ``program`` takes (see the module's docstring)."""
    return _chosen(step_work(program), usable_cores() if cores is None else cores)
