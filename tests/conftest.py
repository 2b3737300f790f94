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
from importlib import metadata

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
