"""``sexpgpu run``, ``evaluate`` and ``bundle`` in processes forked from an interpreter
that has already imported torch.

Most of a small run's cost is ``import torch`` (about 2.6 s of CPU here), paid
again by every process a test starts; the suite starts a few hundred. A
*preloader* is a helper process per set of load-time settings that imports torch,
numpy and safetensors once (nothing of sexpgpu) and then forks a child for each
command it is asked to run. The child is a process of its own as a user's is:

- its own pid, which the test signals and kills for real (``send_signal``,
  ``kill``, a process group after ``start_new_session``);
- the test's pipes as its stdin, stdout and stderr, handed over as file
  descriptors and rebuilt as Python builds them at start-up (``PYTHONUNBUFFERED``
  honoured);
- the test's environment, working folder and ``sys.argv``; sexpgpu and every
  plugin imported fresh, after the environment is in place;
- its real exit status, read by the preloader with ``waitpid`` and handed back
  to the test's :class:`Popen`, so ``wait``, ``poll``, ``communicate`` and
  ``returncode`` behave as usual (a signal's death is a negative code).

What a fork cannot give is kept out, or is loud: a command is forked only when its
environment's load-time settings (``PYTHON*``, ``OMP_*``, ``MKL_*``,
``TORCH*``, locale, ...) are exactly those the preloader started with (the
first preloader of a set is started when the set comes a second time, the
other when it comes a third); two preloaders per set take turns,
each with its own random string-hash seed, so two consecutive runs of a test
(a run and its resume) never share one. Anything else (another command, a
``preexec_fn``, other descriptors, another interpreter or snippet) starts a
fresh interpreter as before, and so does every command under
``SEXPGPU_TEST_FRESH_PROCESSES=1`` or in a test marked ``fresh_process`` (signals
during interpreter start-up, import-time behaviour). A resume whose pinned CPU
choices need other torch start-up settings than the preloader's cannot set them
in a fork; the lowering checks that torch took every pin and refuses one it did
not (``E-CHOICE-001``), so such a test fails rather than passes on other bits.

A forked child forks its own `sexpgpu` processes from the test's preloaders too:
``sexpgpu run --devices N`` is a launcher whose ranks torch's elastic agent starts
as ``python -m sexpgpu_cli run ...`` (each rank's ``TORCHELASTIC_*`` settings are
read only when it joins its group, so they are no load-time settings); each rank
is a process of its own with a real pid the launcher signals and reaps through
its ``Popen`` as before, and the ranks of one launcher come from the two
preloaders in turn.

:func:`install` (called by the suite's conftest) puts :class:`Popen` in place of
``subprocess.Popen``; :func:`shut_down` stops the preloaders.
"""

from __future__ import annotations

import gc
import io
import json
import os
import runpy
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

from tests.inprocess import command_named

FRESH_PROCESSES = "SEXPGPU_TEST_FRESH_PROCESSES"
"""Set to 1 to start every command in a fresh interpreter (the suite is slower)."""

CONSOLE_CODE = "from sexpgpu_cli.main import main; main()"
"""The ``python -c`` snippet the tests run ``sexpgpu`` with."""

MODULE = ["-m", "sexpgpu_cli"]
"""How torch's elastic launcher (``sexpgpu run --devices N``) starts each rank."""

FORKED_COMMANDS = frozenset({"run", "evaluate", "bundle"})
"""The commands that import torch: the only ones a fork saves time on."""

PRELOAD = (
    "torch",
    "numpy",
    "safetensors.numpy",
    "safetensors.torch",
    "structlog",  # with rich, which it imports: 0.35 s
    "jsonschema",
    "click",
    "pluggy",
)
"""What each preloader imports before it forks: third-party modules only, none of
which reads sexpgpu's settings."""

COMPILE_CACHE = "TORCHINDUCTOR_CACHE_DIR"
PRELOAD_TO_COMPILE = ("torch._dynamo", "torch._inductor.compile_fx")
"""Imported too by a preloader whose settings name a compile cache (the compiled
lowering's tests): torch's compiler takes some 5 s to import, more than most of
those runs take to compile from the cache. Its settings (``TORCH*``) are read at
import, and are the preloader's by construction."""

LOAD_TIME_PREFIXES = (
    "PYTHON",
    "ATEN_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "NUMPY",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NVIDIA",
    "TRITON",
    "LD_",
    "MALLOC",
    "LANG",
    "LC_",
)
"""Settings read while an interpreter and torch start: a fork keeps its preloader's."""

RUNTIME_ONLY = ("TORCHELASTIC_", "TORCH_NCCL_")
"""Settings with a load-time prefix that torch reads only when a rank joins its group:
what torch's elastic launcher sets for each rank."""

REBUILT_AT_FORK = frozenset({"PYTHONUNBUFFERED", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE"})
"""Load-time settings the child applies itself: its standard streams, ``sys.path``
and ``sys.dont_write_bytecode``."""

_HEADER = struct.Struct("!I")
_INT = struct.Struct("!i")


# ---------------------------------------------------------------- the test's side


def load_time_settings(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a fork would not honour, as a key."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(LOAD_TIME_PREFIXES)
            and not k.startswith(RUNTIME_ONLY)
            and k not in REBUILT_AT_FORK
        )
    )


class Preloader:
    """One helper process: torch imported, forking a child per request."""

    process: subprocess.Popen | None = None

    @classmethod
    def reached_at(cls, settings: tuple[tuple[str, str], ...], address: str) -> Preloader:
        """The test's preloader at ``address``, as a forked child asks it for its own
        children (a launcher's ranks); the test alone stops it."""
        preloader = cls.__new__(cls)
        preloader.settings, preloader.address = settings, address
        return preloader

    forks = True
    """False for a preloader whose imports initialised CUDA: a child forked from it
    could not use CUDA ("Cannot re-initialize CUDA in forked subprocess"), so its
    commands get fresh interpreters."""

    def __init__(
        self, settings: tuple[tuple[str, str], ...], imports: tuple[str, ...] = ()
    ) -> None:
        self.settings = settings
        self.folder = Path(tempfile.mkdtemp(prefix="sexpgpu-preload-"))
        self.address = str(self.folder / "socket")
        env = {k: v for k, v in os.environ.items() if not k.startswith(LOAD_TIME_PREFIXES)}
        # no PYTHONHASHSEED unless asked: each its own random seed; no PYTHONPATH:
        # each child puts its own in sys.path
        env.update(settings)
        self.process = _ORIGINAL_POPEN(
            [
                sys.executable,
                "-c",
                "from tests.preloaded import serve; serve()",
                self.address,
                *(PRELOAD_TO_COMPILE if COMPILE_CACHE in dict(settings) else ()),
                *imports,
            ],  # fmt: skip
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        ready = self.process.stdout.readline()
        if ready == CUDA_INITIALISED:
            self.forks = False
            self.process.wait()
            return
        if ready != b"ready\n":
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"the preloader did not start: {ready!r}")

    def start(self, request: dict, fds: list[int]) -> tuple[socket.socket, int]:
        """Fork a child for ``request`` with ``fds`` as its 0, 1, 2: the connection
        its exit status will arrive on, and its pid."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.address)
        payload = json.dumps(request).encode()
        socket.send_fds(connection, [_HEADER.pack(len(payload))], fds)
        connection.sendall(payload)
        (pid,) = _INT.unpack(_receive(connection, _INT.size))
        return connection, pid

    def stop(self) -> None:
        """End the preloader (its children, if any, go on as orphans would)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.stdin.close()  # it ends when its stdin does
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        for leftover in self.folder.iterdir():
            leftover.unlink()
        self.folder.rmdir()


class _Preloaders:
    """This test process's preloaders: two per set of load-time settings, the first
    started when the settings come a second time, the other when they come a third."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: Counter[tuple[tuple[str, str], ...]] = Counter()
        self._pairs: dict[tuple[tuple[str, str], ...], list[Preloader | None]] = {}
        self.disabled = 0  # > 0 inside a test marked fresh_process
        self.adopted = False  # a forked child using the test's preloaders

    def for_settings(self, settings: tuple[tuple[str, str], ...]) -> Preloader | None:
        with self._lock:
            if self.disabled or os.environ.get(FRESH_PROCESSES, "") not in ("", "0"):
                return None
            self._seen[settings] += 1
            if self._seen[settings] < 2 and not self.adopted:
                return None
            pair = self._pairs.setdefault(settings, [None, None])
            turn = self._seen[settings] % 2  # each in turn
            if pair[turn] is None and not self.adopted:
                # the second one only once the settings come a third time: a preloader
                # costs what a fresh interpreter does, so settings seen twice gain nothing
                pair[turn] = Preloader(settings)
            preloader = pair[turn]
            return preloader if preloader is None or preloader.forks else None

    def known(self) -> list:
        """Each set of settings with its preloaders' addresses, for a forked child."""
        with self._lock:
            return [[list(k), [p and p.address for p in pair]] for k, pair in self._pairs.items()]

    def adopt(self, known: list) -> None:
        """In a forked child: use the test's preloaders (:meth:`known`), start none."""
        self.adopted = True
        for settings, addresses in known:
            key = tuple(tuple(item) for item in settings)
            self._pairs[key] = [a and Preloader.reached_at(key, a) for a in addresses]

    def shut_down(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                for preloader in filter(None, pair):
                    preloader.stop()
            self._pairs.clear()


PRELOADERS = _Preloaders()
_ORIGINAL_POPEN = subprocess.Popen


def forkable(args: object, kwargs: dict) -> tuple[dict, Preloader] | None:
    """The request and preloader for a ``Popen(args, **kwargs)`` a fork can serve."""
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        return None
    args = list(args)
    cwd = os.path.abspath(kwargs["cwd"]) if kwargs.get("cwd") is not None else os.getcwd()
    module, unbuffered = None, False
    if args[:3] == [sys.executable, "-c", CONSOLE_CODE]:
        argv, path0 = ["-c", *args[3:]], ""
    elif args and args[0] == str(Path(sys.executable).with_name("sexpgpu")):
        argv, path0 = args, str(Path(args[0]).parent)
    elif args[:1] == [sys.executable] and MODULE in (args[1:3], args[2:4]):
        # torch's elastic launcher starting a rank: python [-u] -m sexpgpu_cli ...
        unbuffered = args[1] == "-u"
        argv, path0, module = ["-m", *args[4 if unbuffered else 3 :]], cwd, MODULE[1]
    else:
        return None
    if command_named(argv[1:]) not in FORKED_COMMANDS:
        return None
    allowed = {"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines",
               "encoding", "errors", "start_new_session", "bufsize"}  # fmt: skip
    if set(kwargs) - allowed:
        return None
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    preloader = PRELOADERS.for_settings(load_time_settings(env))
    if preloader is None:
        return None
    request = {
        "argv": argv,
        "path0": path0,
        "module": module,
        "unbuffered": unbuffered,
        "env": env,
        "cwd": cwd,
        "new_session": bool(kwargs.get("start_new_session")),
        "preloaders": PRELOADERS.known(),
    }
    return request, preloader


class Popen(_ORIGINAL_POPEN):
    """``subprocess.Popen``, forking ``sexpgpu run``/``evaluate``/``bundle`` from a preloader
    where it can (see the module's docstring) and starting everything else as usual."""

    def __init__(self, args, *positional, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._forked = None if positional else forkable(args, kwargs)
        self._status: socket.socket | None = None
        super().__init__(args, *positional, **kwargs)

    def _execute_child(  # type: ignore[no-untyped-def]
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
        *rest,
    ):  # fmt: skip
        if self._forked is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                errwrite, *rest,
            )  # fmt: skip
        request, preloader = self._forked
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]  # fmt: skip
        try:
            self._status, self.pid = preloader.start(request, fds)
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _preloader_waitpid(self, pid: int, flags: int) -> tuple[int, int]:
        """``os.waitpid`` for a forked child: its status as the preloader reaped it."""
        status = self._status
        if status is None:
            raise ChildProcessError(f"no status to wait for from {pid}")
        if flags & os.WNOHANG:
            status.setblocking(False)
            try:
                first = status.recv(_INT.size, socket.MSG_PEEK)
            except BlockingIOError:
                return 0, 0
            finally:
                status.setblocking(True)
            if not first:
                raise RuntimeError(f"the preloader of {pid} ended before it")
        (sts,) = _INT.unpack(_receive(status, _INT.size))
        status.close()
        self._status = None
        return pid, sts

    def _try_wait(self, wait_flags):  # type: ignore[no-untyped-def]
        if self._forked is None:
            return super()._try_wait(wait_flags)
        return self._preloader_waitpid(self.pid, wait_flags)

    def _internal_poll(self, _deadstate=None, **_ignored):  # type: ignore[no-untyped-def]
        if self._forked is None:
            return super()._internal_poll(_deadstate)
        return super()._internal_poll(_deadstate, _waitpid=self._preloader_waitpid)


def install() -> None:
    """Use :class:`Popen` for every ``subprocess.Popen`` and ``subprocess.run`` of this process."""
    subprocess.Popen = Popen  # type: ignore[misc]


def shut_down() -> None:
    """Stop this process's preloaders and give ``subprocess.Popen`` back."""
    subprocess.Popen = _ORIGINAL_POPEN  # type: ignore[misc]
    PRELOADERS.shut_down()


def _receive(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        data += chunk
    return data


# ---------------------------------------------------------------- the preloader's side


CUDA_INITIALISED = b"cuda initialised\n"
"""What a preloader answers instead of ``ready`` when its imports initialised CUDA."""


def cuda_initialised() -> bool:
    """Whether this interpreter has initialised CUDA (torch's own record of it)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def serve() -> None:
    """The preloader: import, then fork a child per request until stdin closes.

    Returns only in a forked child, ready to run its command as ``python -c`` or the
    console script would: the interpreter then ends the child as it ends any process
    (an exit status, a traceback, death by SIGINT after a KeyboardInterrupt)."""
    address, *more = sys.argv[1:]
    for name in (*PRELOAD, *more):
        __import__(name)
    if cuda_initialised():
        sys.stdout.buffer.write(CUDA_INITIALISED)
        sys.stdout.flush()
        os._exit(0)
    # What the imports made lives as long as every child does: out of the collector's
    # sight, a child's collections (its last one as it exits above all) neither walk
    # them nor write to their pages, which would copy each page the fork shares.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    waiting: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(key.fd, 4096):
                    os._exit(0)  # the test process is done with it
            elif key.data == "accept":
                connection, _ = listener.accept()
                request, fds = _read_request(connection)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for pidfd, (_, other) in waiting.items():
                        os.close(pidfd)
                        other.close()
                    connection.close()
                    return _become(request, fds)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                waiting[pidfd] = (pid, connection)
                selector.register(pidfd, selectors.EVENT_READ, "child")
                connection.sendall(_INT.pack(pid))
            else:
                pid, connection = waiting.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    connection.sendall(_INT.pack(status))
                except OSError:
                    pass  # the test is gone; so is its interest in the status
                connection.close()


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
    (size,) = _HEADER.unpack(header)
    request = json.loads(_receive(connection, size))
    return request, fds


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the test's descriptors, environment, folder and argv,
    and run the command's code in a fresh ``__main__``."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    # tempfile keeps the first folder it finds: a preloader that imported torch's
    # compiler found its own TMPDIR, and the child would make its temporary files
    # there instead of in the test's (a bundle run's scratch folder, for one)
    tempfile.tempdir = None
    _standard_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")) or request["unbuffered"])
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    sys.orig_argv = [sys.executable, *sys.argv]
    # the preloader started without PYTHONPATH: its sys.path is [argv's folder, the rest]
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [request["path0"], *pythonpath]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    # its own sexpgpu processes (a launcher's ranks) come from the test's preloaders
    PRELOADERS.adopt(request["preloaders"])
    install()
    if request["module"]:  # what python -m does
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return
    main = type(sys)("__main__")
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    if sys.argv[0] == "-c":
        code = CONSOLE_CODE
    else:  # what a console script does
        code = "import sys\nfrom sexpgpu_cli.main import main\nsys.exit(main())"
    exec(compile(code, "<string>", "exec"), main.__dict__)


def _standard_streams(*, unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr as the interpreter builds them at start-up."""
    old = sys.stdout
    encoding, errors = old.encoding, old.errors
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding, errors=errors
    )

    def writer(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        buffered = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffered,  # type: ignore[arg-type]
            encoding=encoding,
            errors=errors,
            line_buffering=fd == 2 or (not unbuffered and os.isatty(fd)),
            write_through=unbuffered,
        )

    sys.stdout = sys.__stdout__ = writer(1, errors)
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace")
