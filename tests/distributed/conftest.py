"""The distributed tests' shared reference run."""

from __future__ import annotations

import pytest

from .kit import STEPS, launch, project


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """An uninterrupted two-rank run of STEPS steps (``:shard none``): its folder, the
    bytes every stopped, killed and resumed two-rank run must end with, whatever
    it shards (an update is per parameter, so owning one changes no bit)."""
    root = project(tmp_path_factory.mktemp("reference"))
    result = launch(root, "--devices", "2", steps=STEPS)
    assert result.returncode == 0, result.stderr
    return root
