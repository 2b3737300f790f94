"""The ``sexpgpu`` console script's first lines: from here on no stop signal is lost.

The console script (and ``python -m sexpgpu_cli``) imports this module before
anything else of sexpgpu, and its first lines take SIGTERM, SIGINT and SIGHUP
with a handler that only notes them. Until then a signal has Python's default
effect, and a SIGINT's ``KeyboardInterrupt`` raised while the import system
runs a module lock's weakref callback is printed and dropped: the run went on.
:func:`sexpgpu_cli.main.main` hands what was noted to the process's watch.
"""

import signal

ARRIVED: list[int] = []
"""The signals that came before the watch took over, in order."""


def _note(signum: int, frame: object) -> None:
    ARRIVED.append(signum)


for _signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_signum, _note)


def main() -> None:
    """Console-script entry point: the command, told what arrived before its watch."""
    from sexpgpu_cli.main import main as command

    command(arrived=ARRIVED)
