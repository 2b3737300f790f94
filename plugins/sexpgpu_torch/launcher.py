"""``LoweringInfo.launch`` of the torch lowerings: the ranks of ``sexpgpu run --devices N``
started on this machine by torch's elastic agent, as ``torchrun`` starts them.

The agent runs the command for N local workers (a c10d rendezvous on 127.0.0.1),
restarts the whole group when one dies (``max_restarts``), and waits; each worker
finds its rank in the agent's environment (``RANK``, ``WORLD_SIZE``...), which is
what :func:`sexpgpu_torch.distributed.join` reads. The outcome comes back as an
exit code and, when the workers did not say it, one line. Forwarding signals and
reading a stopped run's outcome are the caller's (``sexpgpu_cli.launch``): torch's
own handlers are left off, since they would stop the workers with a deadline of
their own.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["launch"]


def launch(
    command: Sequence[str], *, workers: int, max_restarts: int, device: str, logs: str
) -> tuple[int, str | None]:
    """Run ``command`` as ``workers`` ranks through torch's elastic agent and wait; the
    exit code and the line to say (``None``: the workers said it)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if device.split(":", 1)[0] == "cpu":
        # one thread per rank unless asked: N ranks share the machine's cores
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("SEXPGPU_LOG_LEVEL", "").lower() != "debug":
        # torch's agent narrates every start and failure; the outcome is said by the caller
        for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torch before 2.6 has no signals_to_handle: its own handlers then forward the first
    # signal (with its own deadline), and a second one ends the launcher alone
    options: dict[str, Any] = {}
    if "signals_to_handle" in getattr(LaunchConfig, "__dataclass_fields__", {}):
        options["signals_to_handle"] = "SIGQUIT"  # the caller forwards the stop signals
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=f"sexpgpu-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        **options,
    )
    try:
        elastic_launch(config, command[0])(*command[1:])
    except ChildFailedError as error:
        return _failed(error, max_restarts)
    except SignalException as error:
        return 128 + int(error.sigval), None
    except Exception as error:  # the rendezvous or the agent itself: one line
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return 1, f"E-DP-003: the launcher could not run the {workers} workers: {detail}"
    return 0, None


def _failed(error: Any, max_restarts: int) -> tuple[int, str | None]:
    """A worker failed (after the restarts): its own line is printed already, unless
    it was killed, which is said here."""
    rank, failure = error.get_first_failure()
    code = int(failure.exitcode)
    if code > 0:
        return code, None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    restarts = f" after {max_restarts} restarts" if max_restarts else ""
    return 1, f"rank {rank} was killed by {name}{restarts}; the group stopped"
