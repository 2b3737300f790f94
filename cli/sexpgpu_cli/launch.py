"""``sexpgpu run --devices N``: N workers on this machine, through the lowering's launcher.

The ``sexpgpu`` process becomes the launcher: it hands the launcher of the
lowering the run takes (``LoweringInfo.launch``; the torch lowerings': torch's
elastic agent) the command ``python -m sexpgpu_cli <the same arguments>`` for N
local workers, waits, and turns the outcome into the spec's exit code and one
line. Each worker is a plain ``sexpgpu run`` that finds its rank in the
launcher's environment, exactly as under ``torchrun``, which is how several
machines run one program.

Signals. The workers run in sessions of their own, so nothing a terminal or a
job runner sends to the launcher reaches them by itself: the launcher forwards
every delivery of SIGTERM, SIGINT and SIGHUP to every worker, each once and in
order, a worker that starts later included. The workers then do what one
process does (stop after the step every rank agrees on, one checkpoint; a
second SIGTERM or SIGINT ends each at once), and so does the launcher: a second
SIGTERM or SIGINT ends it at once, after forwarding. The lowering's launcher
leaves its own handlers off, since they would stop the workers with a deadline of
their own.

Restarts. ``--max-restarts K`` is the launcher's: a worker that dies (``kill -9``, a
lost peer) restarts the whole group, which with ``--resume latest`` continues
from the newest complete checkpoint. A run a signal stopped must not start
again, so a worker of this launcher that was interrupted exits 0 and rank 0
leaves its exit code in the launch folder, which the launcher exits with.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import PluginError, UsageError
from sexpgpu.extension import E_GROUP

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.opening import Target

__all__ = ["Worker", "in_worker", "launch", "launcher_for"]

LAUNCH_DIR = "SEXPGPU_LAUNCH_DIR"
"""The launcher's folder: each worker's pid file, and rank 0's outcome when interrupted."""
OUTCOME = "outcome.json"
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_FATAL_ON_SECOND = (signal.SIGTERM, signal.SIGINT)


def in_worker() -> bool:
    """Whether a launcher (this one or ``torchrun``) started this process as a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ---------------------------------------------------------------- the worker side


class Worker:
    """What ``sexpgpu run`` does differently as one rank of several: checks
    ``--devices`` against the launcher's count, leaves its pid for the launcher's
    forwarding, keeps the logs of every rank but 0 to warnings, and ends as the
    launcher needs (:meth:`finish`)."""

    def __init__(self, devices: int | None) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        if devices is not None and devices != local:
            if self.rank != 0:  # rank 0 says it
                sys.exit(UsageError.exit_code)
            raise UsageError(
                f"--devices {devices}, and the launcher started {local} workers on this "
                "machine; leave --devices out under torchrun"
            )
        folder = os.environ.get(LAUNCH_DIR)
        self.folder = Path(folder) if folder else None
        if self.folder is not None:
            try:
                (self.folder / f"rank-{self.rank}.pid").write_text(str(os.getpid()))
                if self.rank == 0:  # a restarted group's outcome is its own
                    (self.folder / OUTCOME).unlink(missing_ok=True)
            except OSError:  # the launcher has gone (a second signal): so do we, soon
                self.folder = None
        if self.rank != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from sexpgpu import log

            log.show_from("warning")  # rank 0 tells the run; the others say only what goes wrong

    def run(self, options: Any, catalog: Any) -> Any:
        """``sexpgpu.train.run(options, catalog)``; an error before the first step
        (every rank meets the same one) is said by rank 0 alone."""
        from sexpgpu.errors import SexpError
        from sexpgpu.train import run as run_file

        try:
            return run_file(options, catalog)
        except SexpError as error:
            if self.rank == 0 or error.code == E_GROUP:
                raise
            sys.exit(error.exit_code)

    def finish(
        self, code: int, message: str | None, error: str | None = None
    ) -> tuple[int, str | None]:
        """The exit code and the line this rank ends with, from the run's outcome (and
        the code of the error it failed with, if any). Rank 0 says how the run
        ended; another rank only that it lost the group, or what failed in it alone
        (an op or a bug: its line names the traceback it kept), named by its rank.
        Interrupted under this launcher, every rank exits 0 (no restart) and rank 0
        leaves the code."""
        shown = message if self.rank == 0 or error == E_GROUP else None
        if self.rank != 0 and message and "(traceback in " in message:
            shown = f"rank {self.rank}: {message}"
        if code > 128 and self.folder is not None:
            if self.rank == 0:
                (self.folder / OUTCOME).write_text(json.dumps({"exit_code": code}))
            return 0, shown
        return code, shown


# ---------------------------------------------------------------- the launcher side


Start = Callable[..., tuple[int, str | None]]
"""``LoweringInfo.launch``: ``(command, *, workers, max_restarts, device, logs)`` to the
exit code and the line to say."""


def launcher_for(catalog: Catalog, target: Target) -> Start:
    """The launcher of the lowering a run of ``target`` takes (``--lowering``, else the
    device kind's default); refused as the run itself would refuse that lowering, or
    one that trains on one device only."""
    from sexpgpu.kernels import device_kind
    from sexpgpu.opening import lowering_for

    kind = device_kind(target.device)
    info = lowering_for(catalog, target) or catalog.require(
        "sexpgpu_lowerings", f"the device '{target.device}'", lambda item: kind in item.devices
    )
    if info.launch is None:
        raise PluginError(
            f"the lowering {info.name} cannot train on several devices; run it on one"
        )
    return info.launch


def launch(args: list[str], *, devices: int, max_restarts: int, device: str, start: Start) -> int:
    """Run ``sexpgpu <args>`` as ``devices`` workers through ``start`` (the lowering's
    launcher); returns the exit code (the line, when the workers did not print it, is
    printed here)."""
    # named by the launcher's pid, so a person (or a test) finds its workers' pids
    folder = Path(tempfile.mkdtemp(prefix=f"sexpgpu-launch-{os.getpid()}-"))
    os.environ[LAUNCH_DIR] = str(folder)
    forwarder = _Forwarder(folder)
    try:
        forwarder.install()
        code, line = start(
            [sys.executable, "-m", "sexpgpu_cli", *args],
            workers=devices,
            max_restarts=max_restarts,
            device=device,
            logs=str(folder / "logs"),
        )
        if line:
            _say(line)
        outcome = folder / OUTCOME
        if code == 0 and outcome.exists():
            code = int(json.loads(outcome.read_text())["exit_code"])
        return code
    finally:
        forwarder.uninstall()
        os.environ.pop(LAUNCH_DIR, None)
        shutil.rmtree(folder, ignore_errors=True)


def _say(line: str) -> None:
    sys.stderr.write(f"sexpgpu run: {line}\n")
    sys.stderr.flush()


class _Forwarder:
    """Forwards every delivery of the stop signals to every worker, once each, in order.

    The interpreter writes one byte per delivery to the wakeup pipe, so two
    SIGTERMs in quick succession are two, and a thread forwards them; a worker
    whose pid file appears later gets the deliveries it missed.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.delivered: list[int] = []
        self.sent: dict[int, int] = {}  # worker pid -> deliveries forwarded to it
        self._fds: tuple[int, int, int, int] | None = None
        self._thread: threading.Thread | None = None
        self._previous: dict[int, Any] = {}
        self._previous_wakeup = -1

    def install(self) -> None:
        """Take the stop signals from the process's watch for the launch's duration."""
        from sexpgpu.signals import process_watch

        watch = process_watch()
        if watch is not None:
            watch.interrupt_if_stopping()  # one that came before: nothing started yet
            watch.uninstall()
        read_fd, write_fd = os.pipe()
        stop_read, stop_write = os.pipe()
        for fd in (read_fd, write_fd):
            os.set_blocking(fd, False)
        self._fds = (read_fd, write_fd, stop_read, stop_write)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd)
        for signum in _STOPS:
            self._previous[signum] = signal.signal(signum, lambda *_: None)
        self._thread = threading.Thread(target=self._run, name="sexpgpu-forward", daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        """Stop forwarding and give the signals back."""
        if self._fds is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.write(self._fds[3], b"x")
        if self._thread is not None:
            self._thread.join()
        for fd in self._fds:
            os.close(fd)
        self._fds = None

    def _run(self) -> None:
        assert self._fds is not None
        read_fd, _, stop_fd, _ = self._fds
        while True:
            # polls for workers that started after a delivery, a few times a second
            ready, _, _ = select.select([read_fd, stop_fd], [], [], 0.2)
            if stop_fd in ready:
                return
            if read_fd in ready:
                try:
                    data = os.read(read_fd, 256)
                except BlockingIOError:
                    data = b""
                self.delivered += [s for s in data if s in _STOPS]
            self._forward()
            fatal = [s for s in self.delivered if s in _FATAL_ON_SECOND]
            if len(fatal) > 1:  # the second SIGTERM/SIGINT: every worker has it now
                shutil.rmtree(self.folder, ignore_errors=True)
                os._exit(128 + fatal[1])

    def _forward(self) -> None:
        # the workers known already first: a second signal reaches them at once
        self._send()
        for pid_file in self.folder.glob("rank-*.pid"):
            try:
                self.sent.setdefault(int(pid_file.read_text()), 0)
            except (OSError, ValueError):  # being written
                continue
        self._send()

    def _send(self) -> None:
        # delivery by delivery, so every worker has the first before any has the second
        for index, signum in enumerate(self.delivered):
            for pid, done in list(self.sent.items()):
                if done > index:
                    continue
                self.sent[pid] = index + 1
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:  # exited, or a restart replaced it
                    pass
