"""The preemptible job played out (docs/bundle.md, "Preemptible jobs"): one command,
``sexpgpu run <bundle> --checkpoint-dir <location> --resume latest``, started again
and again, each time stopped at a random moment by SIGTERM (the platform's notice)
or SIGKILL (the machine gone), until a launch finishes the run. Its last checkpoint
must hold the bytes of the same run never stopped. Locally, on S3 and on GCS."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import run_sexpgpu, start_sexpgpu, tensors
from tests.e2e_storage.buckets import Bucket, gcs_admin_client, s3_admin_client
from tests.servers import unique_prefix

pytestmark = pytest.mark.slow

STEPS = 150
PROGRAM = f"""\
(defknob steps {STEPS})
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param hidden [dim dim] :init (normal 0.05))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (gelu (matmul (take embed tokens) hidden)) head)))
(defdata train (arithmetic :digits 3) :seq 32 :batch 64)
(defrun spot
  :model (net 32 96)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01)
  :steps steps
  :checkpoint-every 3
  :seed 5)
"""

LAUNCHES = 6
"""Launches stopped at random moments; the next one is left to finish."""


def _bundle(tmp_path: Path) -> Path:
    (tmp_path / "spot.sx").write_text(PROGRAM)
    made = run_sexpgpu("bundle", "spot.sx", "-o", "spot.sxb", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    return tmp_path / "spot.sxb"


def _wait_for_a_random_moment(process: subprocess.Popen, chance: random.Random) -> str:
    """Let ``process`` run to a random moment: while it starts, or a little after its
    first or second checkpoint of this launch (so every launch but the last gets
    somewhere and none can finish the run, whatever the machine's speed). Returns
    what it said meanwhile."""
    checkpoints = chance.choice([0, 1, 1, 2])
    said = []
    if checkpoints == 0:
        time.sleep(chance.uniform(0.05, 0.6))
        return ""
    while checkpoints:
        line = process.stderr.readline()
        if not line:
            break  # it ended
        said.append(line)
        checkpoints -= '"event": "checkpoint"' in line
    time.sleep(chance.uniform(0.0, 0.15))
    return "".join(said)


def _play(command: list[str], cwd: Path, env: dict[str, str] | None, seed: int) -> list[str]:
    """Launch ``command`` until a launch finishes the run, each of the first
    ``LAUNCHES`` stopped at a random moment by SIGTERM or SIGKILL; returns how each
    launch ended."""
    chance = random.Random(seed)
    ended = []
    for launch in range(LAUNCHES + 1):
        process = start_sexpgpu(*command, cwd=cwd, env=env)
        said = ""
        if launch < LAUNCHES:
            said = _wait_for_a_random_moment(process, chance)
            how = chance.choice([signal.SIGTERM, signal.SIGTERM, signal.SIGKILL])
            if process.poll() is None:
                process.send_signal(how)
        try:
            _, rest = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        stderr = said + rest
        assert "Traceback" not in stderr, stderr
        code = process.returncode
        assert code in (0, 128 + signal.SIGTERM, -signal.SIGKILL), stderr[-3000:]
        ended.append({0: "finished", -signal.SIGKILL: "killed"}.get(code, "SIGTERM"))
        if code == 0:  # this launch finished the run (the last one is never stopped)
            break
    return ended


def _assert_stopped_then_finished(ended: list[str]) -> None:
    """The last launch finished the run and every one before was stopped. A launch
    meant to be stopped may finish the run instead: on a loaded machine this test
    reads a launch's log lines late, and the moment it picks can come after the end;
    most launches are still stopped."""
    assert ended[-1] == "finished" and "finished" not in ended[:-1], ended
    assert len(ended) >= LAUNCHES // 2 + 1, ended


def _compare(final: dict, reference: Path) -> None:
    expected = tensors(reference / f"step-{STEPS:08d}")
    assert sorted(final) == sorted(expected)
    for name in final:
        assert final[name] == expected[name], name


def test_a_bundle_started_again_and_again_ends_as_the_run_never_stopped(tmp_path: Path):
    bundle = _bundle(tmp_path)
    assert run_sexpgpu("run", bundle, "--checkpoint-dir", "ref", cwd=tmp_path).returncode == 0
    command = ["run", str(bundle), "--checkpoint-dir", "spot", "--resume", "latest"]
    ended = _play(command, tmp_path, None, seed=1)
    _assert_stopped_then_finished(ended)
    _compare(tensors(tmp_path / "spot" / f"step-{STEPS:08d}"), tmp_path / "ref")


def _upload(bucket: Bucket, key: str, path: Path) -> None:
    if bucket.scheme == "s3":
        client = s3_admin_client(bucket.endpoint)
        client.put_object(Bucket=bucket.name, Key=key, Body=path.read_bytes())
    else:
        blob = gcs_admin_client(bucket.endpoint).bucket(bucket.name).blob(key)
        blob.upload_from_filename(str(path))


def test_a_bundle_in_a_bucket_started_again_and_again_ends_as_the_run_never_stopped(
    bucket: Bucket, tmp_path: Path
):
    bundle = _bundle(tmp_path)
    assert run_sexpgpu("run", bundle, "--checkpoint-dir", "ref", cwd=tmp_path).returncode == 0
    prefix = unique_prefix()
    _upload(bucket, f"{prefix}/spot.sxb", bundle)
    uri, checkpoints = bucket.uri(f"{prefix}/spot.sxb"), bucket.uri(f"{prefix}/ck")
    command = ["run", uri, "--checkpoint-dir", checkpoints, "--resume", "latest"]
    ended = _play(command, tmp_path, bucket.env(), seed=2 if bucket.scheme == "s3" else 3)
    _assert_stopped_then_finished(ended)
    _compare(bucket.tensors(f"{prefix}/ck/step-{STEPS:08d}"), tmp_path / "ref")
