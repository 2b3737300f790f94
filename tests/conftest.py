"""Suite-wide settings.

The tests talk only to servers they start on 127.0.0.1. The cloud clients'
credential chains would otherwise ask the machine's metadata service (a
link-local address) when no credentials are found, so that lookup is switched
off for every test and every `sexpgpu` subprocess a test starts.

The tests run against the project's own plugins and the throwaway ones they
make, whatever else is installed: every distribution that registers plugins in
the group ``sexpgpu`` and is not ``sexpgpu`` itself is disabled for the session
through ``SEXPGPU_DISABLE_DISTRIBUTIONS``, which every process a test starts
inherits (``tests.foundation.pluginkit.user_env`` keeps it too). The throwaway
plugins are made after this runs, so they are never in the list.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # so that `tests.servers` imports however pytest was started
    sys.path.insert(0, _REPO)

# One moto S3 server and one GCS emulator per worker for the whole suite, whichever
# folders use them (a conftest importing them again would start servers of its own).
from tests.servers import gcs_emulator, moto_s3  # noqa: E402,F401,I001

# `sexpgpu run` and `evaluate` subprocesses forked from interpreters that imported
# torch once (tests/preloaded.py says what they keep of a fresh process).
from tests import preloaded  # noqa: E402

preloaded.install()


def _compile_the_project_once() -> None:
    """Write the bytecode of the project's sources, once, before any worker starts.

    Under ``PYTHONDONTWRITEBYTECODE=1`` (set on many CI machines and containers)
    Python reads ``__pycache__`` but never writes it, so every `sexpgpu` the suite
    starts would compile some 250 modules from source again: about 0.3 s of CPU
    each, a few hundred times. ``compileall`` writes them regardless of that
    setting and skips those whose bytecode is current; the processes only read."""
    import compileall

    for root in ("core", "plugins", "storage_backends", "cli", "tests"):
        compileall.compile_dir(Path(_REPO) / root, quiet=1, workers=1)


if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller, or a run without -n
    _compile_the_project_once()

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "True")

# Two xdist workers already fill a small machine's cores; inductor's pool of compile
# workers would start interpreters that import torch (about 13 s of CPU per cold
# compile of a small transformer here) to compile in parallel on cores that are busy.
# The generated code and its bits do not depend on it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

PROJECT_DISTRIBUTION = "sexpgpu"
ISOLATION_VARIABLE = "SEXPGPU_DISABLE_DISTRIBUTIONS"


def third_party_distributions() -> list[str]:
    """The installed distributions, other than the project, with a ``sexpgpu`` entry point."""
    names = set()
    for entry_point in metadata.entry_points(group="sexpgpu"):
        dist = getattr(entry_point, "dist", None)
        name = dist.metadata["Name"] if dist is not None else None
        if name and name.lower() != PROJECT_DISTRIBUTION:
            names.add(name)
    return sorted(names)


def _isolate_from_third_party_plugins() -> None:
    already = [n for n in os.environ.get(ISOLATION_VARIABLE, "").split(",") if n.strip()]
    names = list(dict.fromkeys([*already, *third_party_distributions()]))
    if names:
        os.environ[ISOLATION_VARIABLE] = ",".join(names)


_isolate_from_third_party_plugins()

# Property tests explore new cases on every developer run; in CI (CI=true) they
# take the same cases every time, so a landing never fails on a case nobody saw.
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")
except ImportError:  # the dev extra is not installed
    pass


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop this process's preloaders."""
    preloaded.shut_down()


@pytest.fixture(autouse=True)
def _fresh_processes_if_marked(request: pytest.FixtureRequest):
    """A test marked ``fresh_process`` starts every command in a new interpreter."""
    marked = request.node.get_closest_marker("fresh_process") is not None
    preloaded.PRELOADERS.disabled += marked
    yield
    preloaded.PRELOADERS.disabled -= marked


# A test that leaves a thread running (a sink's worker retrying for ever, a writer
# never shut down) fails: the thread would go on doing work in later tests.
_THREAD_GRACE = 5.0  # seconds a thread the test stopped gets to finish


@pytest.fixture(autouse=True)
def _no_thread_left_running():
    """Fail a test that leaves a thread of its own running after a short join grace."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + _THREAD_GRACE
    left = []
    for thread in threading.enumerate():
        if thread in before or thread is threading.current_thread():
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            left.append(thread.name)
    assert not left, f"the test left threads running: {', '.join(sorted(left))}"


# ---------------------------------------------------------------- one pytest run, many workers


@pytest.fixture(scope="session")
def torch_compile_cache(request: pytest.FixtureRequest) -> Path:
    """The suite's one folder of torch compile caches (``TORCHINDUCTOR_CACHE_DIR``:
    inductor's FX graph cache and AOTAutograd's), shared by every worker and kept in
    pytest's cache folder from one pytest run to the next (``pytest --cache-clear``
    empties it; CI's clean clone starts cold): a program compiled once is read back
    by every later process, whichever worker starts it. torch keys each entry by the
    graph, its inputs, torch's version and the compiler's settings, and writes them
    atomically, so concurrent processes and later runs may share them. A program the
    suite has not seen (the drawn programs change with each commit) is compiled cold."""
    cache = getattr(request.config, "cache", None)
    if cache is None:  # pytest -p no:cacheprovider: a folder for this run alone
        return request.getfixturevalue("tmp_path_factory").mktemp("torch-compile-cache")
    return cache.mkdir("torch-compile-cache")


@pytest.fixture
def compile_quietly(monkeypatch: pytest.MonkeyPatch, torch_compile_cache: Path):
    """torch.compile in this process: into the pytest run's shared compile caches, and
    on this thread (inductor's pool of compile workers would outlive the test).
    inductor's setting goes through its own ``patch``: pytest's ``monkeypatch`` put it
    back by deleting it, which torch's config module takes as hiding it, and every
    later compile in the worker failed ("compile_threads does not exist")."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(torch_compile_cache))
    with inductor_config.patch(compile_threads=1):
        yield


# The tests that share a module- or package-scoped fixture (a trained run, a server,
# a built wheel) run on one worker, so that the fixture is made once in a run rather
# than once per worker: each worker writes, as it collects, which tests share one
# (``_shared_fixture_scope``), and the controller's scheduler sends each such group to
# one worker as a unit and every other test on its own, as `--dist load` does.
# (pytest-xdist's own ``--dist loadgroup`` cannot be used: it renames the tests
# through an attribute pytest 9 no longer reads.)
GROUPS_INPUT = "sexpgpu_test_groups"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_configure_node(node) -> None:  # type: ignore[no-untyped-def]
    """Controller: tell each worker where to write its tests' groups."""
    node.workerinput[GROUPS_INPUT] = str(_groups_folder(node.config))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """Controller: with the default distribution (``load``), schedule by shared fixture."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    folder = _groups_folder(config)

    class SharedFixtureScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has collected when this is first asked
                self.groups = {}
                for written in sorted(folder.glob("*.json")):
                    self.groups.update(json.loads(written.read_text()))
            return self.groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


def _groups_folder(config: pytest.Config) -> Path:
    folder = getattr(config, "_sexpgpu_groups_folder", None)
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="pytest-groups-"))
        config._sexpgpu_groups_folder = folder  # type: ignore[attr-defined]
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    return folder


@pytest.hookimpl(trylast=True)  # the final list of tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: write which tests share a module- or package-scoped fixture."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or GROUPS_INPUT not in workerinput:
        return
    groups = {}
    for item in items:
        group = _shared_fixture_scope(item)
        if group is not None:
            groups[item.nodeid] = f"shared:{group}"
    target = Path(workerinput[GROUPS_INPUT]) / f"{workerinput['workerid']}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(groups))
    os.replace(partial, target)


def _shared_fixture_scope(item: pytest.Item) -> str | None:
    """The package (a package-scoped fixture) or module (a module-scoped one) whose
    fixture ``item`` uses, if any."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    module = item.nodeid.split("::")[0]
    group = None
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs:
            continue
        scope = defs[-1].scope
        if scope == "package":
            return defs[-1].baseid or module
        if scope == "module":
            group = module
    return group
