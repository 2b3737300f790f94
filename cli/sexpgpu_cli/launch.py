"""``sexpgpu run --devices N``: N workers on this machine, through torch's elastic launcher.

The ``sexpgpu`` process becomes the launcher: it hands torch's
``elastic_launch`` the command ``python -m sexpgpu_cli <the same arguments>``
for N local workers (a c10d rendezvous on 127.0.0.1), waits, and turns the
outcome into the spec's exit code and one line. Each worker is a plain
``sexpgpu run`` that finds its rank in the launcher's environment, exactly as
under ``torchrun``, which is how several machines run one program.

Signals. The workers run in sessions of their own, so nothing a terminal or a
job runner sends to the launcher reaches them by itself: the launcher forwards
every delivery of SIGTERM, SIGINT and SIGHUP to every worker, each once and in
order, a worker that starts later included. The workers then do what one
process does (stop after the step every rank agrees on, one checkpoint; a
second SIGTERM or SIGINT ends each at once), and so does the launcher: a second
SIGTERM or SIGINT ends it at once, after forwarding. Torch's own handlers are
left off (``signals_to_handle``), since they would stop the workers with a
deadline of their own.

Restarts. ``--max-restarts K`` is torch's: a worker that dies (``kill -9``, a
lost peer) restarts the whole group, which with ``--resume latest`` continues
from the newest complete checkpoint. A run a signal stopped must not start
again, so a worker of this launcher that was interrupted exits 0 and rank 0
leaves its exit code in the launch folder, which the launcher exits with.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from sexpgpu.errors import UsageError

__all__ = ["Worker", "in_worker", "launch"]

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
            if self.rank == 0 or error.code == "E-DP-003":
                raise
            sys.exit(error.exit_code)

    def finish(self, code: int, message: str | None) -> tuple[int, str | None]:
        """The exit code and the line this rank ends with. Rank 0 says how the run
        ended; another rank only that it lost the group, or what failed in it alone
        (an op or a bug: its line names the traceback it kept), named by its rank.
        Interrupted under this launcher, every rank exits 0 (no restart) and rank 0
        leaves the code."""
        shown = message if self.rank == 0 or (message and "E-DP-003" in message) else None
        if self.rank != 0 and message and "(traceback in " in message:
            shown = f"rank {self.rank}: {message}"
        if code > 128 and self.folder is not None:
            if self.rank == 0:
                (self.folder / OUTCOME).write_text(json.dumps({"exit_code": code}))
            return 0, shown
        return code, shown


# ---------------------------------------------------------------- the launcher side


def launch(args: list[str], *, devices: int, max_restarts: int, device: str) -> int:
    """Run ``sexpgpu <args>`` as ``devices`` workers through torch's elastic launcher;
    returns the exit code (the line, when the workers did not print it, is printed here)."""
    # named by the launcher's pid, so a person (or a test) finds its workers' pids
    folder = Path(tempfile.mkdtemp(prefix=f"sexpgpu-launch-{os.getpid()}-"))
    os.environ[LAUNCH_DIR] = str(folder)
    if device.split(":", 1)[0] == "cpu":
        # one thread per rank unless asked: N ranks share the machine's cores
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    forwarder = _Forwarder(folder)
    try:
        forwarder.install()
        code = _launch_agent(args, folder, devices=devices, max_restarts=max_restarts)
        outcome = folder / OUTCOME
        if code == 0 and outcome.exists():
            code = int(json.loads(outcome.read_text())["exit_code"])
        return code
    finally:
        forwarder.uninstall()
        os.environ.pop(LAUNCH_DIR, None)
        shutil.rmtree(folder, ignore_errors=True)


def _launch_agent(args: list[str], folder: Path, *, devices: int, max_restarts: int) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if os.environ.get("SEXPGPU_LOG_LEVEL", "").lower() != "debug":
        # torch's agent narrates every start and failure; the outcome is said here
        for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torch before 2.6 has no signals_to_handle: its own handlers then forward the first
    # signal (with its own deadline), and a second one ends the launcher alone
    options: dict[str, Any] = {}
    if "signals_to_handle" in getattr(LaunchConfig, "__dataclass_fields__", {}):
        options["signals_to_handle"] = "SIGQUIT"  # the launcher forwards the stop signals
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=devices,
        run_id=f"sexpgpu-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(folder / "logs")),
        **options,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "sexpgpu_cli", *args)
    except ChildFailedError as error:
        return _failed(error, max_restarts)
    except SignalException as error:
        return 128 + int(error.sigval)
    except Exception as error:  # the rendezvous or the agent itself: one line
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        _say(f"E-DP-003: the launcher could not run the {devices} workers: {detail}")
        return 1
    return 0


def _failed(error: Any, max_restarts: int) -> int:
    """A worker failed (after the restarts): its own line is printed already, unless
    it was killed, which is said here."""
    rank, failure = error.get_first_failure()
    code = int(failure.exitcode)
    if code > 0:
        return code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    restarts = f" after {max_restarts} restarts" if max_restarts else ""
    _say(f"rank {rank} was killed by {name}{restarts}; the group stopped")
    return 1


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
