"""``sexpgpu COMMAND`` run inside the test's own process, for commands that train nothing.

A `sexpgpu` subprocess costs an interpreter and the project's imports (click, the
plugins, matplotlib for ``report``) each time; a command that only reads files
(``check``, ``compile``, ``checkpoint``, ``plugins``, ``runs``, ``report``) gives the
same exit code, stdout and stderr when :func:`sexpgpu` calls the console script's
entry point, ``sexpgpu_cli.main.main(argv)``, in this process. Every such command
keeps at least one test that runs the real console script in a subprocess.

What a fresh process would have is given to each call and taken back after it:

- the environment: ``env`` replaces ``os.environ`` for the call (a subprocess's
  ``PYTHONPATH`` cannot be honoured here, so one that differs is refused);
- the working folder: ``cwd``;
- stdout and stderr: captured as text (click and the log lines write to the
  current ``sys.stdout``/``sys.stderr``), warnings printed to stderr as Python's
  default filters print them, and an uncaught exception printed as its traceback
  with exit code 1, as the interpreter would;
- the signals: ``main(argv)`` hands them back however the command ends;
- process-wide caches of the product: see :func:`_fresh_process_state`, the one
  place that knows them.

Commands that train (``run``, ``evaluate``), that follow a run (``report
--watch``), signals, launchers and servers stay subprocesses: this refuses them,
but for a ``run`` or ``evaluate`` the test expects refused before its program is
lowered (:func:`refused`), which trains nothing either.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

SUBPROCESS_ONLY = frozenset({"run", "evaluate"})
"""The commands that train: a test runs them as a user does, in a process of their own."""


def sexpgpu(
    *args: object, cwd: Path | str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``sexpgpu ARGS`` in this process, in ``cwd`` (default: the current folder)
    with ``env`` as the whole environment (default: the current one); returns what
    ``subprocess.run(..., capture_output=True, text=True)`` would."""
    argv = [str(a) for a in args]
    _refuse_what_needs_a_process(argv, env)
    return _call(argv, cwd, env)


def _call(
    argv: list[str], cwd: Path | str | None, env: Mapping[str, str] | None
) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with (
        _environment(env),
        _working_folder(cwd),
        _fresh_process_state(),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _default_warnings(),
    ):
        code = _main(argv)
    return subprocess.CompletedProcess(
        ["sexpgpu", *argv], code, _newlines(out.getvalue()), _newlines(err.getvalue())
    )


class ReachedLowering(BaseException):
    """Raised in a :func:`refused` command that got as far as lowering its program:
    a BaseException, so that the command's own error handling lets it through."""


def refused(
    *args: object, cwd: Path | str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``sexpgpu run`` or ``evaluate`` that the test expects to be refused before its
    program is lowered (a bad command line, file or checkpoint), run in this process
    as :func:`sexpgpu` runs the commands that train nothing. Nothing of torch's
    process-wide state is touched before lowering; a command that gets as far
    raises :class:`ReachedLowering` into the test instead of training here."""
    import sexpgpu.session as session

    argv = [str(a) for a in args]
    if command_named(argv) not in SUBPROCESS_ONLY:
        raise ValueError("refused() is for sexpgpu run and evaluate; use sexpgpu()")
    if env is not None and env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        raise ValueError("another PYTHONPATH (a throwaway plugin) needs a subprocess")

    def reached(*_: object, **__: object) -> None:
        raise ReachedLowering(f"sexpgpu {' '.join(argv)} was not refused: it lowered")

    lower = session.lower
    session.lower = reached  # type: ignore[assignment]
    try:
        return _call(argv, cwd, env)
    finally:
        session.lower = lower


def _main(argv: list[str]) -> int:
    """The console script's exit status, as a process would end with it."""
    from sexpgpu_cli.main import main

    try:
        main(argv)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        sys.stderr.write(f"{exc.code}\n")  # sys.exit("text") prints it, exit status 1
        return 1
    except Exception:  # noqa: BLE001 - what the interpreter does with an uncaught one
        sys.stderr.write(traceback.format_exc())
        return 1
    return 0


def _refuse_what_needs_a_process(argv: list[str], env: Mapping[str, str] | None) -> None:
    command = command_named(argv)
    if command in SUBPROCESS_ONLY:
        raise ValueError(f"sexpgpu {command} trains: run it in a subprocess")
    if "--watch" in argv:
        raise ValueError("report --watch follows a run until it ends: run it in a subprocess")
    if env is not None and env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        raise ValueError("another PYTHONPATH (a throwaway plugin) needs a subprocess")


def command_named(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is no option nor a root option's value."""
    takes_value = False
    for token in argv:
        if takes_value:
            takes_value = False
        elif token in ("--log-format", "--log-level"):
            takes_value = True
        elif not token.startswith("-"):
            return token
    return None


def _newlines(text: str) -> str:
    """What ``text=True`` reads back from a pipe: universal newlines."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _working_folder(cwd: Path | str | None) -> Iterator[None]:
    saved = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved)


@contextlib.contextmanager
def _default_warnings() -> Iterator[None]:
    """Python's own warning filters, printing to the captured stderr (pytest would
    otherwise collect the warnings a subprocess prints)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning):
            warnings.simplefilter("ignore", category)
        warnings.simplefilter("ignore", ResourceWarning)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = _show_warning
        yield


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _fresh_process_state() -> Iterator[None]:
    """The product's process-wide state as a new process has it, before and after a call.

    This is the one place that knows the product's module-level caches; each is
    reached through ``sys.modules`` only, so nothing here imports a module the
    command would not (and a module that is gone is simply not reset). The plugins
    need nothing: each invocation builds its own catalog, under the call's
    environment. Today:

    - ``sexpgpu_cli.group``: the root group's plugin commands (added per plugin
      set) and the name of the command last invoked (what an error line says).
    - ``sexpgpu.log`` and ``sexpgpu_cli.logstream``: structlog's configuration, set by
      the CLI for the process, and where the CLI's log lines go.
    - ``sexpgpu.signals``: the console script's signal watch, uninstalled should a
      call ever leave it in place.
    """
    import structlog

    group = sys.modules.get("sexpgpu_cli.group")
    commands = dict(group.cli.commands) if group is not None else None
    log = sys.modules.get("sexpgpu.log")
    configured = getattr(log, "_configured", False)
    structlog_config = structlog.get_config()
    structlog.reset_defaults()
    if log is not None:
        log._configured = False
    if group is not None:
        group.LazyGroup.invoked = None
    try:
        yield
    finally:
        signals = sys.modules.get("sexpgpu.signals")
        if signals is not None and signals.process_watch() is not None:
            signals.process_watch().uninstall()
        group = sys.modules.get("sexpgpu_cli.group")
        if group is not None:
            group.LazyGroup.invoked = None
            if commands is not None:
                group.cli.commands.clear()
                group.cli.commands.update(commands)
            else:  # first loaded by this call: keep only the built-in group's own
                for name in list(group.cli.commands):
                    group.cli.commands.pop(name)
        logstream = sys.modules.get("sexpgpu_cli.logstream")
        if logstream is not None:
            logstream.redirect(None)
        log = sys.modules.get("sexpgpu.log")
        if log is not None:
            log._configured = configured
        structlog.configure(**structlog_config)
