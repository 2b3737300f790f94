"""The ``sexpgpu`` command: the signals are taken first, then everything else.

Before click, the plugins or torch are imported, SIGTERM, SIGINT and SIGHUP
are taken (:mod:`sexpgpu.signals`; the console script has noted them from its
first line, :mod:`sexpgpu_cli.console`), so a signal at any moment of a command gives
one line and ``128 + n`` instead of a traceback or a silent death. As the
console script (no ``argv``), they are kept until the process exits, so a
command that has ended keeps its exit status whatever arrives after; called
from Python with ``argv``, the caller gets them back when the command returns.
The click group itself is :mod:`sexpgpu_cli.group`.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence

from sexpgpu.signals import Interrupted, StopWatch, interruption, watch_process
from sexpgpu_cli.commands import BUILTIN_COMMANDS


def main(argv: list[str] | None = None, *, arrived: Sequence[int] = ()) -> None:
    """Run the command ``argv`` names (``sys.argv`` when ``None``: the console script).
    ``arrived``: the signals :mod:`sexpgpu_cli.console` noted before this."""
    watch = watch_process(arrived)  # first thing: nothing heavy is imported yet
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        code = _command(watch, args, console=argv is None)
    finally:
        watch.ended()
        if argv is None:  # the console script: the process is this command's to its end
            watch.hold_until_exit()
            # CPython's finalisation collects garbage several times over every object
            # still alive: with torch, dynamo and inductor imported, 0.3-1.5 s of every
            # command's exit, none of it finding garbage worth the search. Frozen, they
            # are out of the collector's sight; reference counts still free them, and
            # atexit handlers still run.
            gc.freeze()
        else:  # called from Python: the caller gets its signals back, even after a bug
            watch.uninstall()
    if code not in (0, None):
        sys.exit(code)


def _command(watch: StopWatch, args: list[str], *, console: bool) -> int | str | None:
    """Run the command ``args`` name; its exit status, or the signal's when one came
    before the command could handle it. A bug keeps its traceback."""
    try:
        if console and _start_swallowed_an_interrupt():
            raise KeyboardInterrupt
        watch.interrupt_if_stopping()
        from sexpgpu_cli.group import invoke
        from sexpgpu_cli.options import hoist_root_options

        args = hoist_root_options(args)
        return invoke(args)
    except Interrupted:
        return _interrupted_before_the_command_ended(watch, args)
    except KeyboardInterrupt:  # raised by something else than our handler
        watch.ended()
        return _report(args, "SIGINT", 2)
    except Exception as error:
        if interruption(error) is None:
            raise
        return _interrupted_before_the_command_ended(watch, args)


def _start_swallowed_an_interrupt() -> bool:
    """Whether the interpreter's own start took a Ctrl-C and went on: a SIGINT while
    it looks for an importer of ``argv[0]`` is printed ("Failed checking if argv[0]
    is an import path entry") and dropped by CPython, which then runs the script
    anyway. It leaves the exception in ``sys.last_exc``/``sys.last_value``."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return isinstance(last, KeyboardInterrupt)


def _interrupted_before_the_command_ended(watch: StopWatch, args: list[str]) -> int:
    """A signal before the command could handle it: start-up, or a command without
    its own handling. ``sexpgpu run`` says ``at step 0``: the run has read nothing."""
    watch.ended()
    name, signum = watch.settle()
    return _report(args, name, signum)


def _report(args: list[str], name: str, signum: int) -> int:
    command = _command_name(args)
    prefix = f"sexpgpu {command}" if command else "sexpgpu"
    suffix = " at step 0" if command == "run" else ""
    sys.stderr.write(f"{prefix}: interrupted by {name}{suffix}\n")
    sys.stderr.flush()
    return 128 + signum


def _command_name(args: list[str]) -> str | None:
    """The command ``args`` names, as far as start-up has got (no import here)."""
    group = sys.modules.get("sexpgpu_cli.group")
    invoked = getattr(getattr(group, "LazyGroup", None), "invoked", None)
    if invoked:
        return invoked
    takes_value = False
    for token in args:
        if takes_value:
            takes_value = False
        elif token in ("--log-format", "--log-level"):
            takes_value = True
        elif not token.startswith("-"):
            return token if token in BUILTIN_COMMANDS else None
    return None
