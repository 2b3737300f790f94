"""A location a run cannot use stops it before its first step, in one line with its code,
and leaves nothing under the prefix: missing credentials, access denied, no bucket, an
endpoint that refuses connections or never answers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.e2e.helpers import events, experiments, run_sexpgpu, status
from tests.e2e_storage.buckets import Bucket, said
from tests.servers import free_port, new_bucket_name, start_iam_moto, unique_prefix

RUN = ["run", "examples/my-run.sx", "--metrics-dir", "m", "--resume", "latest"]


def assert_refused_before_step_one(done, workdir: Path, code: str) -> str:
    """Exit 1, one line with ``code``, and no step taken; returns the line."""
    assert done.returncode == 1, done.stderr
    (line,) = said(done.stderr)
    assert line.startswith(f"sexpgpu run: {code}: "), line
    for run_dir in experiments(workdir / "m"):
        assert not [e for e in events(run_dir) if e.get("name") == "loss"]
        if (run_dir / "status.json").exists():
            st = status(run_dir)
            assert st["step"] == 0 and st["state"] != "running", st
    return line


def test_no_s3_credentials(s3: Bucket, workdir: Path):
    prefix = unique_prefix()
    env = s3.env()
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    done = run_sexpgpu(*RUN, "--checkpoint-dir", s3.uri(prefix), cwd=workdir, env=env)
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-001")
    assert s3.uri(prefix) in line
    assert s3.objects(prefix) == {}


def test_no_gcs_credentials(workdir: Path, tmp_path: Path, gcs_emulator):
    # Without the emulator, no key file where application-default credentials look,
    # and no metadata server: nothing to authenticate with.
    bucket = Bucket("gs", "sx-e2e-nocreds", gcs_emulator.url, tmp_path)
    env = bucket.env(
        GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing.json"),
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
        NO_GCE_CHECK="True",
    )
    del env["STORAGE_EMULATOR_HOST"]
    done = run_sexpgpu(*RUN, "--checkpoint-dir", "gs://sx-e2e-nocreds/run", cwd=workdir, env=env)
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-001")
    assert "gs://sx-e2e-nocreds/run" in line


def test_no_such_bucket(bucket: Bucket, workdir: Path):
    missing = new_bucket_name("sx-missing")
    done = run_sexpgpu(
        *RUN,
        "--checkpoint-dir",
        f"{bucket.scheme}://{missing}/runs/x",
        cwd=workdir,
        env=bucket.env(),
    )
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-003")
    assert missing in line


def test_an_endpoint_that_does_not_answer(s3: Bucket, workdir: Path):
    prefix = unique_prefix()
    env = s3.env(endpoint=f"http://127.0.0.1:{free_port()}", SEXPGPU_S3_MAX_ATTEMPTS="2")
    done = run_sexpgpu(*RUN, "--checkpoint-dir", s3.uri(prefix), cwd=workdir, env=env)
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-004")
    assert f"listing {s3.uri(prefix)} failed after 2 attempts" in line


# A GCS endpoint nothing answers on. The timeout only guards against a hang: the
# library's own retry deadline is 120 s for each listing, the run's default 5 attempts
# a few seconds.
GCS_HANG_GUARD = 60


def test_a_gcs_endpoint_refusing_connections_fails_with_the_default_attempts(
    workdir: Path, tmp_path: Path
):
    closed = f"http://127.0.0.1:{free_port()}"
    bucket = Bucket("gs", "sx-e2e-unreachable", closed, tmp_path)
    done = run_sexpgpu(
        *RUN,
        "--checkpoint-dir",
        bucket.uri("run"),
        cwd=workdir,
        env=bucket.env(),
        timeout=GCS_HANG_GUARD,
    )
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-004")
    assert f"listing {bucket.uri('run')} failed after 5 attempts: " in line
    assert "Connection refused" in line


def test_a_gcs_endpoint_that_never_answers_times_out(workdir: Path, tmp_path: Path):
    # A socket that listens and is never read: the kernel accepts each connection,
    # nobody answers the request, so only the read timeout ends each attempt.
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        bucket = Bucket("gs", "sx-e2e-silent", endpoint, tmp_path)
        env = bucket.env(SEXPGPU_GCS_MAX_ATTEMPTS="2", SEXPGPU_GCS_READ_TIMEOUT="1")
        done = run_sexpgpu(
            *RUN,
            "--checkpoint-dir",
            bucket.uri("run"),
            cwd=workdir,
            env=env,
            timeout=GCS_HANG_GUARD,
        )
    finally:
        silent.close()
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-004")
    assert f"listing {bucket.uri('run')} failed after 2 attempts: " in line
    assert "Read timed out. (read timeout=1)" in line


# ------------------------------------------------------------ IAM enforced by moto


@pytest.fixture(scope="module")
def iam_moto(tmp_path_factory):
    """moto enforcing IAM (tests.servers.start_iam_moto), as a Bucket per user."""
    server, name, users = start_iam_moto(tmp_path_factory.mktemp("moto-iam"))
    home = tmp_path_factory.mktemp("home-iam")
    yield {u: Bucket("s3", name, server.url, home, *users[u]) for u in users}
    server.stop()


@pytest.mark.parametrize(("user", "doing"), [("reader", "writing"), ("nobody", "listing")])
def test_access_denied(iam_moto, workdir: Path, user: str, doing: str):
    as_user = iam_moto[user]
    prefix = unique_prefix()
    env = as_user.env(AWS_ACCESS_KEY_ID=as_user.key, AWS_SECRET_ACCESS_KEY=as_user.secret)
    done = run_sexpgpu(*RUN, "--checkpoint-dir", as_user.uri(prefix), cwd=workdir, env=env)
    line = assert_refused_before_step_one(done, workdir, "E-STORAGE-002")
    assert f"access denied {doing} {as_user.uri(prefix)}" in line
    assert "(credentials: environment)" in line
    assert as_user.secret not in done.stderr
    assert iam_moto["reader"].objects(prefix) == {}  # the reader may list
