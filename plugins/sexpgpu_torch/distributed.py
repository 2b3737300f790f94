"""The torch lowering's group of ranks: ``torch.distributed``, gloo on the CPU, NCCL on CUDA.

A worker that a launcher started (``sexpgpu run --devices N``, ``torchrun``)
finds its place in the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and joins the process group from it. The group answers the
run loop's questions (:class:`sexpgpu.extension.RankGroup`) with one small
all-reduce each; a step's gradients are averaged by DDP
(:mod:`sexpgpu_torch.placement.replicated`).

Every collective has a timeout (``SEXPGPU_DP_TIMEOUT`` seconds, 300 by
default), so a rank whose peer stopped answering fails instead of waiting for
ever; a peer that died outright closes its sockets and is noticed at once. Either
way the rank raises ``E-DP-003`` with one line.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from sexpgpu.errors import RunError
from sexpgpu.extension import E_GROUP
from sexpgpu.log import get_logger

__all__ = ["TorchGroup", "join"]

DEFAULT_TIMEOUT_S = 300.0
_T = TypeVar("_T")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def join(device: str) -> TorchGroup | None:
    """The group this process is a rank of (``LoweringInfo.group``), or ``None``
    when no launcher started several ranks."""
    if _env_int("WORLD_SIZE", 1) <= 1:
        return None
    return TorchGroup(device)


class TorchGroup:
    """One rank of a ``torch.distributed`` process group (a :class:`RankGroup`)."""

    def __init__(self, device: str) -> None:
        self.rank = _env_int("RANK", 0)
        self.size = _env_int("WORLD_SIZE", 1)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        local_size = max(1, _env_int("LOCAL_WORLD_SIZE", self.size))
        # torchrun and the elastic agent say how many agents (machines) there are;
        # without it, the ranks per machine tell.
        self.nodes = _env_int("GROUP_WORLD_SIZE", max(1, self.size // local_size))
        kind = device.split(":", 1)[0]
        if kind == "cuda":
            # one device per rank on its machine, whatever index the command named
            self.device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(self.local_rank)
            backend = "nccl"
        else:
            self.device = device
            backend = "gloo"
        self._tensor_device = torch.device(self.device)
        self._releases: list[Callable[[], None]] = []
        seconds = float(os.environ.get("SEXPGPU_DP_TIMEOUT", DEFAULT_TIMEOUT_S))
        self.log = get_logger("sexpgpu.ranks")
        timeout = timedelta(seconds=seconds)
        self.call(
            "joining",
            lambda: dist.init_process_group(
                backend=backend,
                store=self._store(timeout),
                rank=self.rank,
                world_size=self.size,
                timeout=timeout,
            ),
        )
        self.log.debug("joined", rank=self.rank, size=self.size, nodes=self.nodes, backend=backend)

    def _store(self, timeout: timedelta) -> Any:
        """The store the ranks meet in. The elastic agent lends its own, one server for
        every restart of the group, where the last attempt's addresses are still
        written: each attempt gets keys of its own, or a restarted group would try
        to reach ranks that are gone. ``None``: torch's own ``env://``."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        shared = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            self.size,
            is_master=False,
            timeout=timeout,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"sexpgpu/attempt-{attempt}/", shared)

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes checkpoints, metrics and the status file."""
        return self.rank == 0

    def call(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, a collective or a step's work that waits on one: a peer lost on
        the way is ``E-DP-003``, one line saying what this rank was doing."""
        try:
            return fn()
        except Exception as error:  # gloo and NCCL raise RuntimeError and their own kinds
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
            # "[.../pair.cc:537] Read error [127.0.0.1]:41369: Connection reset by peer. This
            # is typically caused by...": the first sentence, without the source path
            detail = re.sub(r"^\[[^\]]*\]\s*", "", detail).split(". ")[0]
            raise RunError(
                f"rank {self.rank} of {self.size} lost the group while {what}: another rank "
                f"stopped or cannot be reached ({detail})",
                code=E_GROUP,
            ) from None

    def _reduce(self, what: str, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        self.call(what, lambda: dist.all_reduce(tensor, op=op))

    def max(self, value: int) -> int:
        """The largest of every rank's ``value``."""
        flag = torch.tensor([int(value)], dtype=torch.int64, device=self._tensor_device)
        self._reduce("agreeing", flag, dist.ReduceOp.MAX)
        return int(flag.item())

    def same(self, data: bytes) -> bool:
        """Whether every rank passed the same bytes: their smallest and largest agree."""
        values = torch.tensor(list(data), dtype=torch.int64, device=self._tensor_device)
        low, high = values.clone(), values.clone()
        self._reduce("comparing", low, dist.ReduceOp.MIN)
        self._reduce("comparing", high, dist.ReduceOp.MAX)
        return bool(torch.equal(low, high))

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (in f64)."""
        total = torch.tensor(list(values), dtype=torch.float64, device=self._tensor_device)
        self._reduce("summing", total)
        return total.tolist()

    def backward(self, loss: torch.Tensor, what: str) -> torch.Tensor:
        """``loss.backward()``, whose hooks exchange the gradients (DDP's, FSDP2's), and
        the mean of every rank's loss: its all-reduce goes first, in the same order on
        every rank, and is waited for once the gradients are in. ``what`` names the
        exchange in the ``E-DP-003`` line of a peer lost on the way."""
        mean = loss.detach().clone()

        def exchange() -> None:
            pending = dist.all_reduce(mean, async_op=True)
            if loss.requires_grad:
                loss.backward()
            pending.wait()

        self.call(what, exchange)
        return mean.div_(self.size)

    def on_close(self, release: Callable[[], None]) -> None:
        """Have ``release`` called as the group closes, before it is destroyed: what
        holds on to the process group (DDP's reducer) lets go of it, so the group's
        threads are joined there and then, not in the interpreter's exit (where a
        group still alive aborted a rank, ``terminate called without an active
        exception``, or hung it)."""
        self._releases.append(release)

    def close(self) -> None:
        """Leave the process group (errors ignored: the run's outcome is decided)."""
        for release in self._releases:
            release()
        self._releases.clear()
        gc.collect()  # DDP's module and reducer refer to each other
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as error:  # a peer already gone: nothing left to leave
                self.log.debug("leaving the group failed", error=str(error))
