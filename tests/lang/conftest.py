"""Fixtures for the language tests.

The compiler asks the plugins for data sources and optimizers. These tests put a
small fake plugin (tests/lang/fakeplugin) in place of the installed ones for those
two hooks (two suppliers of `adam` would be a conflict), so the shapes they expect
do not depend on which plugins have landed; the CLI tests run `sexpgpu` with the
project's own plugins.
"""

from __future__ import annotations

import sys

import pytest
from lang_helpers import FAKE


@pytest.fixture(scope="session")
def _fake_plugins():
    from sexpgpu import plugins as P

    sys.path.insert(0, str(FAKE))
    try:
        import sexpgpu_lang_fake
    finally:
        sys.path.remove(str(FAKE))
    loaded = P.Plugins()
    loaded.manager.register(sexpgpu_lang_fake, name="lang-fake")
    hooks = ["sexpgpu_data_sources", "sexpgpu_optimizers"]
    record = P.PluginRecord(
        "lang-fake", "sexpgpu_lang_fake", "tests", "0", hooks=hooks, plugin=sexpgpu_lang_fake
    )
    for other in loaded.records:
        other.hooks = [h for h in other.hooks if h not in hooks]
    loaded.records.insert(0, record)
    return loaded


@pytest.fixture(autouse=True)
def fake_plugins(_fake_plugins, monkeypatch):
    """Every test compiles against the fake plugin first, then the installed ones."""
    from sexpgpu import plugins as P

    monkeypatch.setattr(P, "_plugins", _fake_plugins)
    return _fake_plugins
