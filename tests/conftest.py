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

import os
import threading
import time
from importlib import metadata

import pytest

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "True")

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
