"""sexpgpu.signals.StopWatch on its own: what each signal does in each phase, real
signals sent to this process (or a child for the one that ends a process)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from sexpgpu.signals import HANDLED, Interrupted, StopWatch

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
    watch.interrupt_if_stopping()  # once only: the start-up stop is under way


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
from sexpgpu.run import RunOptions, run

before = signal.getsignal(signal.SIGTERM)
outcome = run(RunOptions(file={example!r}, steps=2, metrics_dir="m"))
assert signal.getsignal(signal.SIGTERM) == before, "the signals were not given back"
assert signal.set_wakeup_fd(-1) == -1, "the wakeup pipe was not given back"
print(outcome.exit_code, outcome.step)
"""


def test_run_called_as_a_library_gives_the_signals_back(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-lm.sx"
    result = run_python(LIBRARY.format(example=str(example)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "0 2\n"
