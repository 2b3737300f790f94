"""Fixtures for the bundle tests: the loopback S3 and GCS servers' shared buckets, and
the compiled lowering's environment."""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # so that `tests.servers` imports however pytest was started
    sys.path.insert(0, _REPO)

from tests.compiled.conftest import compiled_env  # noqa: E402,F401
from tests.e2e_storage.conftest import (  # noqa: E402,F401
    bucket,
    gcs_bucket_name,
    s3_bucket_name,
)
