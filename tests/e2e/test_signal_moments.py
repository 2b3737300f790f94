"""Signals at every moment of `sexpgpu run` (docs/signals.md): at start-up, in pairs
during a step, twice inside one long torch call, while a stop's checkpoint is
written, and once the run has said how it ended.

Real signals to the real console script in a subprocess. A step that takes over a
second comes from a throwaway plugin op, ``hold``, whose forward waits inside one
torch call (``torch.futures.Future.wait``, during which Python runs no signal
handler) for at least HOLD_SECONDS and until the test creates ``release``. So
"both signals arrive during the step" never depends on how fast a loaded machine
is. A throwaway storage, ``slow://``, holds a checkpoint's write the same way
until the test creates ``release-write``. Whether the process has taken the signals, and whether a signal has been
delivered, is read from /proc, never guessed from the clock: no assertion here
depends on timing, and every wait is bounded only against a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.foundation.pluginkit import make_mem_plugin, make_plugin, sexpgpu_command, user_env

from .helpers import (
    EXAMPLES,
    assert_every_checkpoint_complete,
    events,
    experiments,
    status,
    step_dirs,
)

HOLD_PLUGIN = '''
"""hold: the identity, that blocks inside one torch call until the test releases it."""

import os
import threading
import time
from pathlib import Path

from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float


def _torch():
    import torch

    def build(attrs):
        def hold(x):
            if x.device.type == "meta":  # the lowering's check of its output type
                return x
            folder = Path(os.environ["HOLD_DIR"])
            calls = len(list(folder.glob("entered-*"))) + 1
            done = torch.futures.Future()

            def release():
                time.sleep(float(os.environ.get("HOLD_SECONDS", "1.2")))
                bound = time.monotonic() + float(os.environ.get("HOLD_MAX", "60"))
                while not (folder / "release").exists() and time.monotonic() < bound:
                    time.sleep(0.01)
                done.set_result(None)

            threading.Thread(target=release, daemon=True).start()
            (folder / f"entered-{calls}").touch()
            done.wait()
            return x

        return hold

    return build


SPEC = OpSpec("hold", "x, after a long wait inside one torch call", same_float, (Arg("x"),))


@hookimpl
def sexpgpu_ops():
    return [OpInfo("hold", SPEC, {"torch": _torch}, SPEC.doc)]
'''

SLOW_STORAGE = '''
"""slow://: the test mem:// plugin's folder, whose checkpoint writes wait for the test."""

import os
import time
from pathlib import Path

from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu_mem_plugin import MemStorage


class SlowStorage(MemStorage):
    def __init__(self, uri):
        super().__init__("mem://" + uri.removeprefix("slow://"))
        self.uri = uri.rstrip("/")

    def write(self, key, data):
        if key.startswith("step-"):
            gate = Path(os.environ["HOLD_DIR"])
            (gate / "writing").touch()
            bound = time.monotonic() + 60
            while not (gate / "release-write").exists() and time.monotonic() < bound:
                time.sleep(0.01)
        super().write(key, data)


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(schemes=("slow",), factory=SlowStorage, doc="held writes")]
'''

PROGRAM = """
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.5))
  (param head [dim vocab] :init (normal 0.5))
  (forward (tokens) (matmul (hold (take embed tokens)) head)))
(defdata train (arithmetic :digits 2) :seq 10 :batch 4)
(defrun held
  :model (net 16 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.05)
  :steps 3
  :seed 3)
"""

NAMES = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}
BOUND = 120.0
"""Seconds after which a wait counts as a hang (never reached by a passing test)."""
RUN = ["--metrics-dir", "m", "--checkpoint-dir", "ckpt"]


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    make_mem_plugin(root)
    make_plugin(root, "sexpgpu-slow", {"sexpgpu_slow": SLOW_STORAGE}, {"slow": "sexpgpu_slow"})
    return make_plugin(
        root, "sexpgpu-hold", {"sexpgpu_hold": HOLD_PLUGIN}, {"hold": "sexpgpu_hold"}
    )


@pytest.fixture
def site(tmp_path: Path, plugins: Path) -> Path:
    """A user's folder with held.sx, the examples and the hold plugin's folder."""
    (tmp_path / "held.sx").write_text(PROGRAM)
    (tmp_path / "hold").mkdir()
    import shutil

    shutil.copytree(EXAMPLES, tmp_path / "examples")
    return tmp_path


def start(site: Path, plugins: Path, *args: str, **env: str) -> subprocess.Popen:
    """``sexpgpu ARGS`` from the console script, JSON logs, the hold plugin installed."""
    return subprocess.Popen(
        [*sexpgpu_command(), *args],
        cwd=site,
        env=user_env(
            [plugins],
            SEXPGPU_LOG_FORMAT="json",
            HOLD_DIR=str(site / "hold"),
            MEM_PLUGIN_ROOT=str(site / "objects"),
            **env,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _mask(pid: int, field: str) -> int:
    """A signal mask of /proc/<pid>/status (bit n-1 is signal n); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def takes_signals(pid: int) -> bool:
    """Whether sexpgpu's handlers are in place (Python alone catches neither SIGTERM nor
    SIGHUP; SIGHUP is the last of the three taken)."""
    bits = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
    return _mask(pid, "SigCgt") & bits == bits


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {BOUND}s"
        time.sleep(0.002)


def send_delivered(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` and wait until the process has taken it off its pending set, so
    that a second one sent after it is a second delivery (the kernel merges a signal
    sent while the same one is still pending)."""
    os.kill(proc.pid, signum)
    bit = 1 << (signum - 1)
    wait_until(
        lambda: (
            proc.poll() is not None
            or not (_mask(proc.pid, "ShdPnd") | _mask(proc.pid, "SigPnd")) & bit
        ),
        f"delivery of signal {signum}",
    )


def finish(proc: subprocess.Popen, went_on: Path | None = None) -> tuple[str, str]:
    """``proc``'s output once it has ended; a hang, or the file ``went_on`` appearing
    (the run reached a step it should not), fails at once with its stderr."""
    deadline = time.monotonic() + BOUND
    while went_on is not None and proc.poll() is None and time.monotonic() < deadline:
        if went_on.exists():
            break
        time.sleep(0.01)  # the few kB a start-up logs fit in the pipes meanwhile
    if went_on is None or not went_on.exists():
        try:
            return proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    masks = _masks(proc.pid)  # what it did with its signals says why it hung
    proc.kill()
    out, err = proc.communicate()
    what = "went on" if went_on is not None and went_on.exists() else "hung"
    raise AssertionError(f"sexpgpu {what} ({masks}; ours {_masks(os.getpid())}):\n{err[-3000:]}")


def _masks(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "gone"
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(("Sig", "Shd")))


def finish_reading(proc: subprocess.Popen, seen: list[str]) -> str:
    """The whole of stderr once the process has ended, ``seen`` being read already
    through the file object (whose buffer ``communicate`` would not see)."""
    try:
        proc.wait(timeout=BOUND)  # the few kB a short run logs fit in the pipe
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("sexpgpu hung:\n" + "".join(seen)) from None
    return "".join(seen) + proc.stderr.read()


def the_run(site: Path) -> Path:
    (run_dir,) = experiments(site / "m")
    return run_dir


def annotations(run_dir: Path) -> list[str]:
    return [e["text"] for e in events(run_dir) if e.get("kind") == "annotation"]


def assert_stopped_at_start_up(site: Path, proc: subprocess.Popen, err: str, name: str) -> None:
    """The whole of a start-up stop: one line, 128 + n, nothing written."""
    assert proc.returncode == 128 + NAMES[name], err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"sexpgpu run: interrupted by {name} at step 0"
    # no checkpoint (the location's write probe may be left when cut off mid-check)
    assert not (site / "ckpt").exists() or not step_dirs(site / "ckpt")
    for run_dir in experiments(site / "m"):  # a stop after the metrics opened
        assert status(run_dir)["state"] == "interrupted"


# ------------------------------------------------------------------ start-up

INTERPRETER_REPORT = "Failed checking if argv[0] is an import path entry"


def without_interpreter_report(err: str) -> str:
    """``err`` less the report CPython prints when a Ctrl-C lands while it looks for
    an importer of ``argv[0]``: it prints the KeyboardInterrupt and runs the script
    anyway, and sexpgpu then stops as for a signal at its start (its line follows)."""
    if not err.startswith(INTERPRETER_REPORT):
        return err
    lines = err.splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.startswith("KeyboardInterrupt"))
    return "".join(lines[end + 1 :])


def test_a_ctrl_c_the_interpreter_drops_at_its_start_still_stops_the_run(site, plugins):
    # CPython drops a KeyboardInterrupt raised while it checks argv[0] (printed,
    # then the script runs; the suite once hit it): the script finds it in
    # sys.last_value. Left there as CPython leaves it, the run must not start.
    script = (
        "import sys; sys.last_value = KeyboardInterrupt(); "
        "from sexpgpu_cli.main import main; "
        f"sys.argv = ['sexpgpu', 'run', 'held.sx', *{list(RUN)!r}]; main()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=site,
        env=user_env([plugins], HOLD_DIR=str(site / "hold"), MEM_PLUGIN_ROOT=str(site / "objects")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = finish(proc)
    assert err == "sexpgpu run: interrupted by SIGINT at step 0\n"
    assert_stopped_at_start_up(site, proc, err, "SIGINT")
    assert not (site / "m").exists()


@pytest.mark.fresh_process  # the interpreter's own start-up is part of the moment
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("after", [0.010, 0.050, 0.100])
def test_a_signal_soon_after_launch(site, plugins, name, after):
    proc = start(site, plugins, "run", "held.sx", *RUN, "--resume", "latest")
    launched = time.monotonic()
    while time.monotonic() - launched < after:
        pass  # a busy wait: a sleep on a loaded machine can take much longer
    in_place = takes_signals(proc.pid)
    os.kill(proc.pid, NAMES[name])
    try:
        out, err = finish(proc, went_on=site / "hold" / "entered-1")
    except AssertionError as lost:
        if in_place or name != "SIGINT":
            raise
        # Before sexpgpu's first line (sexpgpu_cli.console), the interpreter's own
        # start-up: a KeyboardInterrupt raised in a module lock's weakref callback is
        # printed and dropped by Python, and the run goes on (docs/signals.md).
        pytest.xfail(f"a SIGINT in the interpreter's start-up was dropped: {lost}")
    if in_place or proc.returncode == 128 + NAMES[name]:
        # sexpgpu's first lines had run: the whole of a start-up stop
        assert_stopped_at_start_up(site, proc, without_interpreter_report(err), name)
    else:
        # The interpreter had not yet reached sexpgpu's first line (its own start
        # takes tens of milliseconds): the signal's default action, nothing done.
        # Python's own SIGINT handler is in place before that line: KeyboardInterrupt.
        assert not (site / "m").exists() and not (site / "ckpt").exists()
        if name == "SIGINT" and "init_sys_streams" in err:
            # earlier still: CPython's own stream set-up interrupted, which it reports
            # as a fatal error of its own; nothing of sexpgpu ran (as just asserted)
            assert err.startswith("Fatal Python error: init_sys_streams") and proc.returncode
        elif name == "SIGINT" and err:
            assert err.rstrip().endswith("KeyboardInterrupt") and proc.returncode in (1, -2)
        else:
            assert (proc.returncode, err) == (-NAMES[name], "")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("after", [0.010, 0.050, 0.100])
def test_a_signal_at_any_moment_of_start_up_stops_with_one_line(site, plugins, name, after):
    # Counted from the moment sexpgpu has taken the signals: these land in the
    # imports, the plugins' loading, the compile or the lowering.
    (site / "hold" / "release").touch()  # a step, if one is reached, is not held
    proc = start(site, plugins, "run", "held.sx", *RUN, "--resume", "latest")
    wait_until(lambda: takes_signals(proc.pid) or proc.poll() is not None, "handlers")
    time.sleep(after)
    os.kill(proc.pid, NAMES[name])
    out, err = finish(proc)
    if proc.returncode == 128 + NAMES[name] and "at step 0" not in err:
        # slow enough to have reached the step loop: the stop at a step boundary
        assert err.splitlines()[-1].startswith(f"sexpgpu run: interrupted by {name} at step ")
        assert status(the_run(site))["state"] == "interrupted"
    else:
        assert_stopped_at_start_up(site, proc, err, name)


def test_a_signal_before_a_command_is_known_names_no_step(site, plugins):
    proc = start(site, plugins, "check", "held.sx")
    wait_until(lambda: takes_signals(proc.pid) or proc.poll() is not None, "handlers")
    os.kill(proc.pid, signal.SIGTERM)
    out, err = finish(proc)
    if proc.returncode == 0:  # it ended before the signal came: nothing to stop
        assert "held.sx: run held" in out
    else:
        assert proc.returncode == 143, err
        assert err.splitlines()[-1] == "sexpgpu check: interrupted by SIGTERM"


# ------------------------------------------------------------- during a step


def start_held(site: Path, plugins: Path, **env: str) -> subprocess.Popen:
    """A run whose first step is in flight, inside its long torch call, on return."""
    proc = start(site, plugins, "run", "held.sx", *RUN, **env)
    wait_until(lambda: (site / "hold" / "entered-1").exists() or proc.poll() is not None, "step")
    assert proc.poll() is None, proc.communicate()[1]
    return proc


@pytest.mark.parametrize("gap", [0.001, 0.050, 0.500])
@pytest.mark.parametrize("first, second", [("SIGTERM", "SIGHUP"), ("SIGHUP", "SIGTERM")])
def test_sigterm_and_sighup_in_either_order_are_one_stop_named_sigterm(
    site, plugins, first, second, gap
):
    proc = start_held(site, plugins)
    os.kill(proc.pid, NAMES[first])
    time.sleep(gap)
    os.kill(proc.pid, NAMES[second])
    (site / "hold" / "release").touch()
    out, err = finish(proc)
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == "sexpgpu run: interrupted by SIGTERM at step 1"
    run_dir = the_run(site)
    assert status(run_dir)["state"] == "interrupted"
    assert "interrupted by SIGTERM at step 1" in annotations(run_dir)
    assert not [a for a in annotations(run_dir) if "SIGHUP" in a]
    assert os.listdir(site / "ckpt") == ["step-00000001"]
    assert_every_checkpoint_complete(site / "ckpt")


def test_a_sigterm_while_a_sighup_stop_writes_its_checkpoint_changes_nothing(site, plugins):
    # A SIGHUP alone is a stop named SIGHUP, reported before its checkpoint is
    # written (the spec's order); a SIGTERM during that write is not a second
    # fatal signal (the first SIGTERM), so it neither renames nor ends the stop.
    proc = start(
        site, plugins, "run", "held.sx", "--metrics-dir", "m", "--checkpoint-dir", "slow://b"
    )
    wait_until(lambda: (site / "hold" / "entered-1").exists() or proc.poll() is not None, "step")
    send_delivered(proc, signal.SIGHUP)
    (site / "hold" / "release").touch()
    wait_until(lambda: (site / "hold" / "writing").exists() or proc.poll() is not None, "write")
    send_delivered(proc, signal.SIGTERM)  # the stop is under way, its checkpoint not stored
    (site / "hold" / "release-write").touch()
    out, err = finish(proc)
    assert proc.returncode == 129, err
    assert err.splitlines()[-1] == "sexpgpu run: interrupted by SIGHUP at step 1"
    run_dir = the_run(site)
    notes = annotations(run_dir)
    assert "interrupted by SIGHUP at step 1" in notes
    assert not [a for a in notes if "SIGTERM" in a]
    # reported first, then the checkpoint of that step
    stop = notes.index("interrupted by SIGHUP at step 1")
    assert [i for i, a in enumerate(notes) if a.startswith("checkpoint ")] == [stop + 1]
    assert_every_checkpoint_complete(site / "objects" / "b")
    assert step_dirs(site / "objects" / "b") == ["step-00000001"]


@pytest.mark.parametrize("late", ["SIGHUP", "SIGINT", "SIGTERM"])
def test_a_signal_after_the_stop_is_reported_changes_nothing(site, plugins, late):
    proc = start_held(site, plugins)
    send_delivered(proc, signal.SIGTERM)
    (site / "hold" / "release").touch()
    seen = read_until(proc, "run interrupted")
    send_delivered(proc, NAMES[late])
    err = finish_reading(proc, seen)
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == "sexpgpu run: interrupted by SIGTERM at step 1"
    assert status(the_run(site))["state"] == "interrupted"


@pytest.mark.parametrize("gap", [0.001, 0.500])
@pytest.mark.parametrize(
    "first, second", [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGINT"), ("SIGTERM", "SIGINT")]
)
def test_a_second_signal_inside_one_long_torch_call_ends_the_process_at_once(
    site, plugins, first, second, gap
):
    # The step is never released (HOLD_MAX far beyond BOUND): only the second
    # signal, counted while Python cannot run a handler, can end this process.
    proc = start_held(site, plugins, HOLD_MAX="100000")
    send_delivered(proc, NAMES[first])
    time.sleep(gap)
    os.kill(proc.pid, NAMES[second])
    out, err = finish(proc)
    assert proc.returncode == 128 + NAMES[second], err
    assert "interrupted by" not in err  # nothing of the orderly stop
    run_dir = the_run(site)
    assert status(run_dir)["state"] == "running"
    assert not [a for a in annotations(run_dir) if a.startswith("interrupted")]
    assert not (site / "ckpt").exists() or not os.listdir(site / "ckpt")


@pytest.mark.parametrize("first, second", [("SIGHUP", "SIGHUP"), ("SIGHUP", "SIGINT")])
def test_a_sighup_never_ends_the_process_at_once(site, plugins, first, second):
    proc = start_held(site, plugins)
    send_delivered(proc, NAMES[first])
    send_delivered(proc, NAMES[second])
    (site / "hold" / "release").touch()
    out, err = finish(proc)
    assert proc.returncode == 128 + NAMES[second], err
    assert err.splitlines()[-1] == f"sexpgpu run: interrupted by {second} at step 1"
    assert status(the_run(site))["state"] == "interrupted"


# ------------------------------------------------------------------ the end


def read_until(proc: subprocess.Popen, event: str) -> list[str]:
    """stderr's JSON log lines up to and with the one of ``event``."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            return lines
    raise AssertionError(f"no `{event}`:\n" + "".join(lines))


@pytest.mark.parametrize(
    "sent", [["SIGTERM"], ["SIGINT"], ["SIGHUP"], ["SIGTERM", "SIGTERM"], ["SIGHUP", "SIGTERM"]]
)
def test_a_run_that_finished_exits_0_whatever_arrives_after(site, plugins, sent):
    proc = start(site, plugins, "run", "examples/tiny-lm.sx", "--steps", "3", *RUN)
    seen = read_until(proc, "run finished")
    for name in sent:
        send_delivered(proc, NAMES[name])
    err = finish_reading(proc, seen)
    assert proc.returncode == 0, err
    assert "interrupted" not in err
    run_dir = the_run(site)
    assert status(run_dir)["state"] == "finished"
    assert events(run_dir)[-1]["kind"] == "done"
