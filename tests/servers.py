"""Real storage servers on loopback for tests: moto's S3 server, the GCS emulator, and a
byte-counting TCP forwarder.

Each server is a subprocess on 127.0.0.1 at a free port, stopped by its PID. The
session-scoped fixtures (``moto_s3``, ``gcs_emulator``) start one server for the whole
test session (per xdist worker): ``tests/conftest.py`` imports them once for every
folder. A conftest or module that imports them again gets servers of its own.

Function-scoped helpers (``s3_env``, ``gcs_env``) point boto3 / google-cloud-storage at
them through the standard environment variables, with throwaway credentials.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"
_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _tool(name: str) -> str:
    path = _BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def _wait_for_port(port: int, process: subprocess.Popen, what: str, limit: float = 60.0) -> None:
    # Readiness is "accepts a TCP connection"; a deadline only guards against a hang.
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before listening")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {LOOPBACK}:{port}")


@dataclass
class Server:
    """A server subprocess on loopback."""

    name: str
    port: int
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it has not gone within a few seconds."""
        if self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _start(name: str, argv: list[str], port: int, log_dir: Path, env: dict | None) -> Server:
    log = log_dir / f"{name}-{port}.log"
    full_env = dict(os.environ)
    full_env.update(env or {})
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
        )
    server = Server(name=name, port=port, process=process, log=log)
    try:
        _wait_for_port(port, process, name)
    except BaseException:
        server.stop()
        raise
    return server


def start_moto(log_dir: Path, *, env: dict | None = None) -> Server:
    """moto's S3 server on a free loopback port.

    For access-denied tests give ``env={"INITIAL_NO_AUTH_ACTION_COUNT": "N"}``: moto
    enforces IAM after its first N requests.
    """
    port = free_port()
    argv = [_tool("moto_server"), "-H", LOOPBACK, "-p", str(port)]
    return _start("moto", argv, port, log_dir, env)


def start_iam_moto(log_dir: Path) -> tuple[Server, str, dict[str, tuple[str, str]]]:
    """A moto server that enforces IAM once it is set up: a bucket, and two users with
    keys, ``reader`` (may only list the bucket) and ``nobody`` (may do nothing).

    Returns (server, bucket, {user: (access key id, secret)}); the caller stops it.
    """
    import json

    import boto3

    setup_calls = 6  # counted below; moto enforces IAM from the next request on
    server = start_moto(log_dir, env={"INITIAL_NO_AUTH_ACTION_COUNT": str(setup_calls)})
    try:
        bucket = new_bucket_name("sx-iam")
        admin = {
            "endpoint_url": server.url,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }
        boto3.client("s3", **admin).create_bucket(Bucket=bucket)  # 1
        iam = boto3.client("iam", **admin)
        users = {}
        for name in ("reader", "nobody"):
            iam.create_user(UserName=name)  # 2, 4
            key = iam.create_access_key(UserName=name)["AccessKey"]  # 3, 5
            users[name] = (key["AccessKeyId"], key["SecretAccessKey"])
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                # s3:List*, not s3:ListBucket alone: moto 5.2.6 checks ListObjectsV2 under
                # an action of that name, where AWS checks s3:ListBucket
                {"Effect": "Allow", "Action": "s3:List*", "Resource": f"arn:aws:s3:::{bucket}"}
            ],
        }
        iam.put_user_policy(  # 6
            UserName="reader", PolicyName="list", PolicyDocument=json.dumps(policy)
        )
    except BaseException:
        server.stop()
        raise
    return server, bucket, users


def start_gcs_emulator(log_dir: Path) -> Server:
    """gcp-storage-emulator, in memory, on a free loopback port."""
    port = free_port()
    argv = [
        _tool("gcp-storage-emulator"),
        "start",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--in-memory",
        "--quiet",
    ]
    return _start("gcs-emulator", argv, port, log_dir, None)


# ---------------------------------------------------------------- counting forwarder


@dataclass
class CountingProxy:
    """A TCP forwarder on loopback that counts the bytes passing each way.

    Point a client's endpoint at ``proxy.url`` instead of the server's; then
    ``proxy.downstream`` is every byte the server sent (responses), ``upstream``
    every byte the client sent (requests).
    """

    target_port: int
    port: int = 0
    upstream: int = 0
    downstream: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _listener: socket.socket | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<proxy port>``."""
        return f"http://{LOOPBACK}:{self.port}"

    def reset(self) -> None:
        """Zero both counters."""
        with self._lock:
            self.upstream = self.downstream = 0

    def start(self) -> CountingProxy:
        """Listen and forward in background threads."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, 0))
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop accepting and close the listener; open connections end on their own."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._pipe, args=(client,), daemon=True)
            thread.start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection((LOOPBACK, self.target_port))
        except OSError:
            client.close()
            return
        sockets = [client, server]
        try:
            while not self._stopping.is_set():
                readable, _, _ = select.select(sockets, [], [], 0.5)
                for sock in readable:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    # Counted before forwarding: once the peer has the bytes, the
                    # counter already shows them.
                    with self._lock:
                        if sock is client:
                            self.upstream += len(data)
                        else:
                            self.downstream += len(data)
                    (server if sock is client else client).sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One moto S3 server for the session (IAM not enforced: any keys work)."""
    server = start_moto(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One in-memory GCS emulator for the session."""
    server = start_gcs_emulator(tmp_path_factory.mktemp("gcs"))
    yield server
    server.stop()


S3_ISOLATION = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_S3_UNSET = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "SEXPGPU_CHECKPOINT_PROFILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)


def point_s3_at(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path, *, keys: bool = True
) -> None:
    """Environment for boto3 to use ``endpoint`` with test keys and no user config.

    ``keys=False`` leaves no credentials anywhere (for "no credentials" tests);
    the instance-metadata lookup is disabled so that it fails at once.
    """
    for name in _S3_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_ISOLATION.items():
        if keys or name == "AWS_DEFAULT_REGION":
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)


def unique_prefix() -> str:
    """A prefix inside a shared bucket that no other test uses."""
    return f"runs/{uuid.uuid4().hex[:10]}"


def new_bucket_name(stem: str = "sx") -> str:
    """A fresh, valid bucket name."""
    return f"{stem}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_env(moto_s3: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Server:
    """boto3 pointed at the session's moto server through AWS_ENDPOINT_URL_S3."""
    point_s3_at(monkeypatch, moto_s3.url, tmp_path)
    return moto_s3


def point_gcs_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Environment for google-cloud-storage to use the emulator at ``endpoint``."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "sexpgpu-test")
    monkeypatch.delenv("SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS", raising=False)


@pytest.fixture
def gcs_env(gcs_emulator: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    """google-cloud-storage pointed at the session's emulator through STORAGE_EMULATOR_HOST."""
    point_gcs_at(monkeypatch, gcs_emulator.url)
    return gcs_emulator
