"""Suite-wide settings.

The tests talk only to servers they start on 127.0.0.1. The cloud clients'
credential chains would otherwise ask the machine's metadata service (a
link-local address) when no credentials are found, so that lookup is switched
off for every test and every `sexpgpu` subprocess a test starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "True")

# Property tests explore new cases on every developer run; in CI (CI=true) they
# take the same cases every time, so a landing never fails on a case nobody saw.
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")
except ImportError:  # the dev extra is not installed
    pass
