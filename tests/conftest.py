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
