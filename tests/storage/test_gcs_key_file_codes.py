"""An undecodable GCS key file is E-STORAGE-001 (no credentials) whichever variable
names it (docs/storage.md, "GCS credentials"): `sexpgpu run` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SEXPGPU = str(Path(sys.executable).with_name("sexpgpu"))
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my-run.sx"

# a service-account key whose private key is not a key: the file reads, the key does not
BAD_KEY = {
    "type": "service_account",
    "project_id": "p",
    "private_key_id": "0",
    "private_key": "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n",
    "client_email": "someone@p.iam.gserviceaccount.com",
    "token_uri": "https://oauth2.googleapis.com/token",
}


@pytest.mark.parametrize(
    "variable", ["SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS", "GOOGLE_APPLICATION_CREDENTIALS"]
)
def test_an_undecodable_key_file_is_no_credentials_through_either_variable(tmp_path, variable):
    key = tmp_path / "key.json"
    key.write_text(json.dumps(BAD_KEY))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SEXPGPU_", "GOOGLE_", "STORAGE_EMULATOR"))
    }
    env.update({variable: str(key), "NO_GCE_CHECK": "True", "CLOUDSDK_CONFIG": str(tmp_path)})
    r = subprocess.run(
        [SEXPGPU, "run", str(EXAMPLE), "--checkpoint-dir", "gs://bucket/run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("sexpgpu run: E-STORAGE-001: no GCS credentials for gs://bucket/run"), (
        line
    )
    assert "Traceback" not in r.stderr
