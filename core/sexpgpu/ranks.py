"""The ranks of a run: one process alone (:data:`SOLO`, whose answers need no other), or
one of several a launcher started, in the group a lowering's ``LoweringInfo.group``
joins (torch's: ``torch.distributed``). A run joins before it reads a checkpoint: the
device and node counts it records and compares (``E-DP-002``) are the group's.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sexpgpu.errors import PluginError, RunError, UsageError
from sexpgpu.extension import E_GROUP, RankGroup, Trainer
from sexpgpu.lang.ir import Program

if TYPE_CHECKING:
    from sexpgpu.signals import StopWatch


E_BATCH = "E-DP-001"


@dataclass(frozen=True)
class Solo:
    """The group of one process: rank 0 of 1 on 1 node, and every answer its own."""

    device: str = "cpu"
    rank: int = 0
    size: int = 1
    nodes: int = 1

    @property
    def is_writer(self) -> bool:
        return True

    def max(self, value: int) -> int:
        return value

    def same(self, data: bytes) -> bool:
        return True

    def sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def close(self) -> None:
        """Nothing to leave."""


SOLO = Solo()
"""One process alone on the CPU."""


def launched_size() -> int:
    """How many ranks the launcher that started this process says there are
    (``WORLD_SIZE``, which ``torchrun`` and ``sexpgpu run --devices`` set), 1 without one."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def join_group(device: str, lowerings: list) -> RankGroup:
    """The group this process is a rank of, on ``device``: :class:`Solo` unless a
    launcher started several ranks, then the group an available lowering serving
    the device kind joins. Raises :class:`PluginError` when none can."""
    if launched_size() == 1:
        return Solo(device=device)
    kind = device.split(":", 1)[0]
    for info in lowerings:
        if info.group is not None and kind in info.devices:
            group = info.group(device)
            if group is not None:
                return group
    raise PluginError(
        f"the launcher started {launched_size()} ranks, and no installed lowering can "
        f"train on several '{kind}' devices"
    )


def check_batches(program: Program, group: RankGroup) -> None:
    """Refuse, before any step, a training batch the ranks cannot split evenly:
    ``:batch`` is the global batch, and each rank takes ``batch / size`` of it."""
    if group.size == 1:
        return
    for decl in (stage.data for stage in program.stages):
        if decl.batch % group.size:
            raise UsageError(
                f"{decl.pos}: {E_BATCH}: the batch of {decl.batch} records does not split "
                f"evenly across {group.size} devices; make :batch a multiple of {group.size}"
            )


class StopAgreement:
    """Whether the ranks stop at a step boundary, and on which signal: one rank asks its
    watch; several all-reduce the signal each has (0: none), so every rank stops after
    the same step, named by the largest: SIGTERM (15) over SIGINT (2) over SIGHUP (1).
    Every rank must ask at the same boundaries."""

    def __init__(self, group: RankGroup, watch: StopWatch) -> None:
        self.group = group
        self.watch = watch
        self.agreed = 0

    def stopping(self) -> bool:
        """Whether to stop now (a collective with several ranks)."""
        if self.group.size == 1:
            return self.watch.stopping
        # a SIGHUP waits for a SIGTERM sent with it
        local = self.watch.settle()[1] if self.watch.stopping else 0
        self.agreed = self.group.max(local)
        return self.agreed > 0

    def settle(self) -> tuple[str, int]:
        """The stop's signal name and number, fixed from now on."""
        if self.group.size == 1 or not self.agreed:
            return self.watch.settle()
        return signal.Signals(self.agreed).name, self.agreed

    def pass_may_stop(self) -> bool:
        """An eval pass stops at a signal on one rank; on several it finishes, since
        the ranks look for a signal only together (the spec's rule)."""
        return self.group.size == 1 and self.watch.stopping


def check_replicas(group: RankGroup, trainer: Trainer, step: int) -> None:
    """At the end, every rank must hold the same parameters and states, to the byte
    (the sha256 of every tensor ``export`` gives, by name): a rank that drifted is
    ``E-DP-003``, never a silent average of different models. Ranks of slices
    (``holds_replicas`` false) compare nothing. It is also where the other ranks
    wait for rank 0's last checkpoint to be stored."""
    if group.size == 1:
        return
    digest = hashlib.sha256()
    exports = trainer.export(reuse=True) if trainer.holds_replicas else ()  # the last one's buffers
    for tensors in exports:
        for name in sorted(tensors):
            digest.update(name.encode())
            digest.update(tensors[name].tobytes())
    if not group.same(digest.digest()):
        raise RunError(
            f"the {group.size} ranks hold different parameters after step {step}",
            code=E_GROUP,
        )
