"""sexpgpu.signals.StopWatch on its own: what each signal does in each phase, real
signals sent to this process (or a child for the one that ends a process)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from sexpgpu.signals import HANDLED, Interrupted, StopWatch, interruption

from .pluginkit import run_python

BOUND = 60.0


def wait_for(predicate) -> None:
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, "nothing within the bound"
        time.sleep(0.002)


@pytest.fixture
def watch():
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    watch = StopWatch()
    watch.install()
    yield watch
    watch.uninstall()
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before
    assert signal.set_wakeup_fd(-1) == -1  # the pipe was given back too
    assert not [t for t in threading.enumerate() if t.name == "sexpgpu-signals"]


def test_before_the_loop_the_first_signal_interrupts_at_once(watch):
    with pytest.raises(Interrupted) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: False)
    assert stop.value.signum == signal.SIGTERM
    assert watch.settle() == ("SIGTERM", signal.SIGTERM)


def test_a_signal_noted_while_installing_interrupts_right_after(watch):
    watch._note(signal.SIGHUP)  # as the handler does before install() arms it
    with pytest.raises(Interrupted) as stop:
        watch.interrupt_if_stopping()
    assert stop.value.signum == signal.SIGHUP


class _SignalledWhileNamed:
    """A descriptor whose ``__set_name__`` is where the signal's handler runs."""

    def __set_name__(self, owner, name):
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: False)


def test_an_interrupt_wrapped_by_a_class_body_is_still_the_signals(watch):
    # Python 3.11 wraps what a __set_name__ raises in a RuntimeError: an import
    # defining such a class (platform.uname_result) was where CI's signal landed.
    with pytest.raises(BaseException) as raised:

        class Named:
            field = _SignalledWhileNamed()

    found = interruption(raised.value)
    assert found is not None and found.signum == signal.SIGINT
    assert interruption(RuntimeError("unrelated")) is None


class _SignalledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_swallowed_on_the_way_is_raised_again_at_the_check(watch):
    # An exception raised in __del__ is only printed: the run would go on.
    _SignalledWhileCollected()  # collected at once, its exception ignored
    assert watch.stopping
    with pytest.raises(Interrupted) as stop:
        watch.interrupt_if_stopping()
    assert stop.value.signum == signal.SIGTERM
    watch.loop_started()
    watch.interrupt_if_stopping()  # once the loop runs, the loop stops it instead


def test_the_command_ends_as_the_signal_says_when_an_import_wraps_it(tmp_path):
    # The CI case end to end: start-up's import of a class whose __set_name__ is
    # running when SIGINT lands. One line and 128 + 2, no traceback.
    result = run_python(
        """
        import os, signal, time
        import sexpgpu_cli.group as group

        class Signalled:
            def __set_name__(self, owner, name):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(60)

        def invoke(args):
            class Named:
                field = Signalled()

        group.invoke = invoke
        from sexpgpu_cli.main import main
        main(["run", "examples/tiny-lm.sx"])
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stderr == "sexpgpu run: interrupted by SIGINT at step 0\n"


def test_an_interrupt_python_drops_is_neither_printed_nor_lost(tmp_path):
    # A signal landing in a weakref callback an import's module lock sets (CI saw
    # it) or in a __del__: Python prints the exception with a traceback and drops
    # it. The run still stops at the check, and the only line is sexpgpu's.
    result = run_python(
        """
        import os, signal, time
        import sexpgpu_cli.group as group

        class Signalled:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)

        def invoke(args):
            Signalled()  # collected at once, its exception dropped
            time.sleep(60)  # the watch raises it again, here, without being asked
            print("not raised")

        group.invoke = invoke
        from sexpgpu_cli.main import main
        main(["run", "examples/tiny-lm.sx"])
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stderr == "sexpgpu run: interrupted by SIGTERM at step 0\n"


IN_THE_IMPORT_SYSTEM = """
import os, signal, sys, time
from sexpgpu.signals import Interrupted, StopWatch

# A frame of the import system's code, as a module lock's weakref callback runs in.
scope = {}
exec(compile("import sys; frame = sys._getframe()", "<frozen importlib._bootstrap>", "exec"), scope)
watch = StopWatch()
watch.install()
try:
    watch._handle(signal.SIGINT, scope["frame"])  # the handler, run there: no raise
    print("not raised there", flush=True)
    time.sleep(60)  # raised here instead, a moment later
except Interrupted as stop:
    print("raised after", stop.signum, flush=True)
watch.loop_started()
os.kill(os.getpid(), signal.SIGINT)  # the first delivery the pipe counts: the loop's stop
while not watch.stopping:
    time.sleep(0.001)
time.sleep(0.2)
print("counted once", flush=True)
os.kill(os.getpid(), signal.SIGINT)  # the second: ends the process at once
time.sleep(60)
"""


def test_a_signal_in_the_import_system_is_raised_once_the_main_thread_is_out(tmp_path):
    # Raised in a module lock's weakref callback, Python would print and drop it, or
    # leave the import lock held. The handler asks to run again instead, and the
    # delivery it makes for that is not counted as a second signal.
    result = run_python(IN_THE_IMPORT_SYSTEM, cwd=tmp_path)
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stdout == "not raised there\nraised after 2\ncounted once\n"
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("sent", "named"), [(["SIGINT"], "SIGINT"), (["SIGHUP", "SIGTERM", "SIGTERM"], "SIGTERM")]
)
def test_signals_the_console_script_noted_before_its_watch_stop_the_command(tmp_path, sent, named):
    # sexpgpu_cli.console takes the signals at its first line and only notes them;
    # the watch, installed after the imports it needs, acts on what was noted.
    kills = "; ".join(f"os.kill(os.getpid(), signal.{name})" for name in sent)
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-lm.sx"
    result = run_python(
        f"""
        import os, signal, sys
        import sexpgpu_cli.console as console
        {kills}
        sys.argv = ["sexpgpu", "run", {str(example)!r}, "--checkpoint-dir", "c"]
        console.main()
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 128 + signal.Signals[named], result.stderr
    assert result.stderr == f"sexpgpu run: interrupted by {named} at step 0\n"
    assert not (tmp_path / "c").exists()


def test_the_watch_gives_back_the_hook_for_dropped_exceptions():
    import sys

    before = sys.unraisablehook
    watch = StopWatch()
    watch.install()
    assert sys.unraisablehook != before
    watch.uninstall()
    assert sys.unraisablehook == before


@pytest.mark.parametrize("order", [("SIGHUP", "SIGTERM"), ("SIGTERM", "SIGHUP")])
def test_in_the_loop_a_pair_is_one_stop_named_by_the_sigterm(watch, order):
    watch.loop_started()
    assert not watch.stopping and watch.name is None
    for name in order:
        os.kill(os.getpid(), signal.Signals[name])
        wait_for(lambda name=name: watch.name in (name, "SIGTERM"))
    wait_for(lambda: watch.name == "SIGTERM")  # the watcher thread counted both
    assert watch.stopping and watch.settle() == ("SIGTERM", signal.SIGTERM)


def test_a_settled_name_stays(watch):
    watch.loop_started()
    os.kill(os.getpid(), signal.SIGHUP)
    wait_for(lambda: watch.stopping)
    assert watch.settle() == ("SIGHUP", signal.SIGHUP)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # whatever the watcher does meanwhile, the name is kept
    assert watch.name == "SIGHUP"


def test_once_ended_nothing_counts(watch):
    watch.ended()
    for _ in range(3):  # two of them would end the process were it still running
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
    assert not watch.stopping


SECOND = """
import os, signal, sys, time
from sexpgpu.signals import StopWatch
watch = StopWatch()
watch.install()
watch.loop_started()
os.kill(os.getpid(), signal.SIGTERM)
while not watch.stopping:
    time.sleep(0.001)
print("stopping", flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(60)
print("not ended", flush=True)
"""


def test_a_second_sigterm_or_sigint_ends_the_process_at_once(tmp_path):
    result = run_python(SECOND, cwd=tmp_path)
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stdout == "stopping\n"


def test_a_forked_child_gets_the_signals_back(watch):
    pid = os.fork()
    if pid == 0:  # the child: not the run; its signals are its own again
        ok = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1
        os._exit(0 if ok else 1)
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    assert signal.getsignal(signal.SIGTERM) == watch._handle


LIBRARY = """
import signal
from sexpgpu.catalog import Catalog
from sexpgpu.session import Selection
from sexpgpu.train import RunOptions, run

before = signal.getsignal(signal.SIGTERM)
outcome = run(RunOptions(Selection({example!r}, steps=2), metrics_dir="m"), Catalog.load())
assert signal.getsignal(signal.SIGTERM) == before, "the signals were not given back"
assert signal.set_wakeup_fd(-1) == -1, "the wakeup pipe was not given back"
print(outcome.exit_code, outcome.step)
"""


def test_run_called_as_a_library_gives_the_signals_back(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-lm.sx"
    result = run_python(LIBRARY.format(example=str(example)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "0 2\n"


def test_the_console_entry_called_from_python_gives_the_signals_back_after_a_bug(monkeypatch):
    """``main(argv)`` hands the signals, the wakeup pipe and its thread back however the
    command ends, a bug's exception included (it keeps its traceback)."""
    import sexpgpu_cli.group as group
    from sexpgpu_cli.main import main

    def bug(args):
        raise RuntimeError("a bug in a command")

    monkeypatch.setattr(group, "invoke", bug)
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    with pytest.raises(RuntimeError, match="a bug in a command"):
        main(["check", "x.sx"])
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before
    assert signal.set_wakeup_fd(-1) == -1
    assert "sexpgpu-signals" not in {t.name for t in threading.enumerate()}
