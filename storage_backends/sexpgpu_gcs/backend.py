"""A checkpoint location in Google Cloud Storage: resumable uploads for large objects,
concurrent writes, ranged reads, generation identity.

Credentials are application-default (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's
application-default login, the metadata server), or the key file named by
``SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS``; with ``STORAGE_EMULATOR_HOST`` set the
client talks to that emulator anonymously.
"""

from __future__ import annotations

import io
import itertools
import os
import secrets
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import google.auth
import google.auth.exceptions as gauth_exc
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from sexpgpu.checkpoint.storage import (
    ACCESS_DENIED,
    CANNOT_LIST,
    NO_CREDENTIALS,
    NO_SUCH_LOCATION,
    PROBE_PREFIX,
    READ_FAILED,
    WRITE_FAILED,
    int_setting,
    redact,
    split_bucket_uri,
)
from sexpgpu.errors import StorageError
from sexpgpu.extension import ObjectIdentity, Storage

SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)

MIB = 1 << 20
_CHUNK_UNIT = 256 * 1024  # resumable chunks must be multiples of 256 KiB
RESUMABLE_ABOVE = 8 * MIB  # larger objects go up as resumable uploads, as gsutil does

BUCKET_METADATA_OFF = "DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA"
"""google-cloud-storage's switch for its background bucket-metadata lookups."""


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of a ``gs://`` URI."""
    return split_bucket_uri(uri, "gs")


class AttemptsRetry(Retry):
    """google-cloud-storage's ``DEFAULT_RETRY`` (what it retries, its backoff), ending
    each request after ``attempts`` tries with a :class:`~google.api_core.exceptions.RetryError`.

    api_core bounds retries by a deadline only (120 s by default, so an endpoint that
    refuses connections took two minutes to fail); botocore by attempts, which
    ``SEXPGPU_S3_MAX_ATTEMPTS`` sets. Counting them here makes
    ``SEXPGPU_GCS_MAX_ATTEMPTS`` mean the same. The library wraps each request
    (a page of a listing, a chunk of an upload) on its own, so the count is per request.
    The settings of the Retry itself are api_core's defaults, the same as
    ``DEFAULT_RETRY``'s, for a library version that reads them instead of calling it.
    """

    def __init__(self, attempts: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attempts = attempts

    def __call__(self, func: Any, on_error: Any = None) -> Any:
        """``func`` retried as ``DEFAULT_RETRY`` retries it, at most ``attempts`` times."""
        failures = itertools.count(1)

        def give_up(exc: Exception) -> None:
            if on_error is not None:
                on_error(exc)
            if next(failures) >= self.attempts:
                # RetryError is how api_core itself says it stopped retrying.
                raise gexc.RetryError(f"after {self.attempts} attempts", exc) from exc

        return DEFAULT_RETRY(func, on_error=give_up)


class GcsStorage(Storage):
    """A ``gs://bucket/prefix`` location opened with the checkpoint credentials."""

    takes_crc32c = True  # GCS verifies each upload against its crc32c

    def __init__(self, uri: str) -> None:
        self.bucket_name, self.prefix = split_uri(uri)
        self.uri = (
            f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"
        )
        # Resumable uploads go in chunks of this size: fewer, larger requests are
        # faster, and a failed chunk is all that is sent again.
        self.chunk_size = int_setting("SEXPGPU_GCS_CHUNK_SIZE_MB", 100, 1) * MIB
        self.concurrency = int_setting("SEXPGPU_GCS_CONCURRENCY", 8, 1)
        self.max_attempts = int_setting("SEXPGPU_GCS_MAX_ATTEMPTS", 5, 1)
        self.retry = AttemptsRetry(self.max_attempts)
        # (connect, read) seconds of each request, as the S3 backend's botocore Config.
        self.timeout = (
            int_setting("SEXPGPU_GCS_CONNECT_TIMEOUT", 10, 1),
            int_setting("SEXPGPU_GCS_READ_TIMEOUT", 60, 1),
        )
        self._lock = threading.Lock()
        self._client: Any = None
        self._source = "not yet resolved"

    # -- client, made on first use

    @property
    def client(self) -> Any:
        """The google-cloud-storage client (one per location)."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        # The client would otherwise GET each bucket's metadata from a thread of its
        # own, for tracing labels only: a request nobody asked for (refused without
        # bucket-level permission), and a thread left behind for up to 10 s.
        os.environ.setdefault(BUCKET_METADATA_OFF, "true")
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or None
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            # The emulator has no auth; the client needs a project name all the same.
            self._source = "anonymous (STORAGE_EMULATOR_HOST)"
            return storage.Client(project=project or "sexpgpu", credentials=AnonymousCredentials())
        key_file = os.environ.get("SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS", "").strip()
        try:
            if key_file:
                self._source = "SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS"
                credentials, found = _load_key_file(key_file)
            else:
                credentials, found = google.auth.default(scopes=list(SCOPES))
                self._source = _describe_default(credentials)
        except gauth_exc.DefaultCredentialsError as exc:
            where = f"the key file {key_file}" if key_file else "application-default credentials"
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StorageError(
                f"no GCS credentials for {self.uri}: {where} could not be loaded ({first})",
                code=NO_CREDENTIALS,
            ) from None
        return storage.Client(project=project or found, credentials=credentials)

    def credential_source(self) -> str:
        """Where the credentials come from, in words (never the credentials)."""
        try:
            self.client  # noqa: B018 - resolves the source
        except StorageError:
            return "none found"
        return self._source

    def _name(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.prefix}/{key}" if self.prefix and key else (self.prefix or key)

    def _where(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.uri}/{key}" if key else self.uri

    def _error(self, exc: Exception, doing: str, key: str, code: str) -> StorageError:
        """:meth:`_explain`, with the credentials of any URL in it (an endpoint's
        ``user:password@``) redacted."""
        error = self._explain(exc, doing, key, code)
        return StorageError(redact(error.message), code=error.code)

    def _explain(self, exc: Exception, doing: str, key: str, code: str) -> StorageError:
        """One line for a failed call: what, where, the credential source, a stable code."""
        if isinstance(exc, StorageError):
            return exc
        where = self._where(key)
        source = self._source
        if isinstance(exc, gauth_exc.RefreshError):
            return StorageError(
                f"the GCS credentials ({source}) could not be refreshed {doing} {where}",
                code=NO_CREDENTIALS,
            )
        if isinstance(exc, gexc.Unauthorized):
            return StorageError(
                f"access denied {doing} {where}: the credentials ({source}) were not accepted",
                code=ACCESS_DENIED,
            )
        if isinstance(exc, gexc.Forbidden):
            return StorageError(
                f"access denied {doing} {where} (credentials: {source})", code=ACCESS_DENIED
            )
        if isinstance(exc, gexc.NotFound):
            if doing == "listing" or "bucket" in str(exc).lower():
                return StorageError(
                    f"no such bucket {self.bucket_name} {doing} {where} (credentials: {source})",
                    code=NO_SUCH_LOCATION,
                )
            return StorageError(f"{where} does not exist", code=NO_SUCH_LOCATION)
        failed = "failed"
        if isinstance(exc, gexc.RetryError):
            # The last error is the one to tell; the count (or api_core's own deadline,
            # "Timeout of 120.0s exceeded") is how the retries ended.
            ours = exc.message.startswith("after ")
            failed = f"failed {exc.message}" if ours else f"failed ({exc.message})"
            exc = exc.cause if isinstance(exc.cause, Exception) else exc
        detail = _detail(exc)
        return StorageError(
            f"{doing} {where} {failed}: {detail[:300]} (credentials: {source})", code=code
        )

    # -- Storage

    def describe(self) -> str:
        """The location, the credential source and an emulator when one is used."""
        text = f"{self.uri} (credentials: {self.credential_source()}"
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            text += f", endpoint {redact(emulator)}"
        return text + ")"

    def check_writable(self) -> None:
        """List the prefix, upload a small probe object and delete it."""
        try:
            iterator = self.client.list_blobs(
                self.bucket_name,
                prefix=self._name("") + "/" if self.prefix else "",
                max_results=1,
                retry=self.retry,
                timeout=self.timeout,
            )
            list(iterator)
        except Exception as exc:
            raise self._error(exc, "listing", "", CANNOT_LIST) from None
        probe = PROBE_PREFIX + secrets.token_hex(6)
        self.write(probe, b"sexpgpu write probe\n")
        self.delete(probe)

    def list_children(self, prefix: str = "") -> list[str]:
        """Names of objects and prefixes one level under ``prefix``, every page."""
        full = self._name(prefix)
        full = full + "/" if full else ""
        names: set[str] = set()
        try:
            iterator = self.client.list_blobs(
                self.bucket_name, prefix=full, delimiter="/", retry=self.retry, timeout=self.timeout
            )
            for page in iterator.pages:
                for blob in page:
                    names.add(blob.name[len(full) :])
                for common in page.prefixes:
                    names.add(common[len(full) :].rstrip("/"))
        except Exception as exc:
            raise self._error(exc, "listing", prefix, CANNOT_LIST) from None
        return sorted(n for n in names if n and not n.startswith(PROBE_PREFIX))

    def _blob(self, key: str) -> Any:
        return self.client.bucket(self.bucket_name).blob(self._name(key))

    def exists(self, key: str) -> bool:
        """Whether an object is at ``key``."""
        try:
            return bool(self._blob(key).exists(retry=self.retry, timeout=self.timeout))
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None

    def read(self, key: str) -> bytes:
        """The whole object."""
        try:
            return self._blob(key).download_as_bytes(retry=self.retry, timeout=self.timeout)
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """A ranged GET of ``length`` bytes from ``start``; fewer at the end of the object."""
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        if length == 0:
            return b""
        try:
            return self._blob(key).download_as_bytes(
                start=start, end=start + length - 1, retry=self.retry, timeout=self.timeout
            )
        except gexc.RequestRangeNotSatisfiable:
            return b""  # start at or past the end
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None

    def write(self, key: str, data: bytes | memoryview, crc32c: str | None = None) -> None:
        """One upload: a single request when small, a resumable upload in chunks when large.

        An object appears only when its upload finishes, so each is all or nothing.
        ``crc32c`` (base64, as GCS writes it) goes with the upload's metadata: GCS
        verifies it and refuses the object when the bytes it got differ.
        """
        if not key.strip("/"):
            raise StorageError(f"{self.uri}: cannot write an object without a name")
        view = memoryview(data).cast("B")
        try:
            if len(view) > RESUMABLE_ABOVE:
                chunk = max(_CHUNK_UNIT, self.chunk_size // _CHUNK_UNIT * _CHUNK_UNIT)
                blob = self.client.bucket(self.bucket_name).blob(self._name(key), chunk_size=chunk)
            else:
                blob = self._blob(key)
            if crc32c:
                blob.crc32c = crc32c
            # Rewriting a checkpoint file with the same bytes is harmless, so uploads
            # retry transient failures even without a generation precondition.
            blob.upload_from_file(
                _ViewReader(view),
                size=len(view),
                content_type="application/octet-stream",
                retry=self.retry,
                timeout=self.timeout,
            )
        except Exception as exc:
            raise self._error(exc, "writing", key, WRITE_FAILED) from None

    def write_many(
        self,
        items: Mapping[str, bytes | memoryview],
        crc32c: Mapping[str, str] | None = None,
    ) -> None:
        """Upload every object on its own thread; the first failure is raised once all
        finish. ``crc32c`` maps a key to its object's CRC32C, verified by GCS (see
        :meth:`write`)."""
        crc32c = crc32c or {}
        if len(items) <= 1:
            for key, data in items.items():
                self.write(key, data, crc32c.get(key))
            return
        self.client  # noqa: B018 - made once, before the threads share it
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as pool:
            futures = [
                pool.submit(self.write, key, data, crc32c.get(key)) for key, data in items.items()
            ]
        for future in futures:
            future.result()

    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""
        try:
            self._blob(key).delete(retry=self.retry, timeout=self.timeout)
        except gexc.NotFound:
            return
        except Exception as exc:
            raise self._error(exc, "deleting", key, WRITE_FAILED) from None

    def identity(self, key: str) -> ObjectIdentity:
        """Size and ``generation:<n>``: GCS gives each write of an object a new generation."""
        try:
            blob = self.client.bucket(self.bucket_name).get_blob(
                self._name(key), retry=self.retry, timeout=self.timeout
            )
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None
        if blob is None:
            raise StorageError(f"{self._where(key)} does not exist", code=NO_SUCH_LOCATION)
        if blob.generation is not None:
            version = f"generation:{blob.generation}"
        else:  # not seen from GCS itself; kept for stores that leave generations out
            version = f"md5:{blob.md5_hash}"
        return ObjectIdentity(size=int(blob.size), version=version)


def _detail(exc: Exception) -> str:
    """An error's text on one line. requests wraps a connection's failure in urllib3's
    "Max retries exceeded with url: ..." (its own retries are off): the reason inside
    it (``Connection refused``, ``Read timed out``) is what says what happened."""
    inner = exc.args[0] if exc.args else None
    reason = getattr(inner, "reason", None)
    if isinstance(reason, Exception):
        text = _connection_failure(reason) or str(reason)
    else:
        text = str(exc)
    return " ".join(text.split()) or type(exc).__name__


def _connection_failure(error: Exception) -> str | None:
    """A connection's failure naming its endpoint once. urllib3 writes the connection
    (its host and port, or an object's address) before a reason that may name the
    host again: ``HTTPConnection(host='h', port=9): Failed to resolve 'h' (...)``."""
    from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

    if isinstance(error, NewConnectionError):
        conn = error.conn
        message = str(error).removeprefix(f"{conn}: ")
        if conn is None or isinstance(error, NameResolutionError):
            return message  # "Failed to resolve 'h' (...)": the host, once
        return f"{conn.host}:{conn.port}: {message}"
    if isinstance(error, ConnectTimeoutError):  # (connection, "Connection to h timed out. ...")
        said = [arg for arg in error.args if isinstance(arg, str)]
        return said[-1] if said else None
    return None


class _ViewReader(io.RawIOBase):
    """A seekable read-only stream over a memoryview: the upload copies one chunk at a
    time instead of the whole object (``io.BytesIO`` would copy it all up front)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = (
            len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        )
        data = self._view[self._pos : end].tobytes()
        self._pos = max(self._pos, end)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _load_key_file(path: str) -> tuple[Any, str | None]:
    """Credentials from a service-account key or an authorized-user file."""
    import json

    from google.oauth2 import credentials as user_credentials
    from google.oauth2 import service_account

    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise gauth_exc.DefaultCredentialsError(
            f"cannot read it: {getattr(exc, 'strerror', None) or type(exc).__name__}"
        ) from None
    kind = info.get("type") if isinstance(info, dict) else None
    try:  # an undecodable key is E-STORAGE-001, as through GOOGLE_APPLICATION_CREDENTIALS
        if kind == "service_account":
            creds = service_account.Credentials.from_service_account_info(info, scopes=list(SCOPES))
            return creds, info.get("project_id")
        if kind == "authorized_user":
            creds = user_credentials.Credentials.from_authorized_user_info(
                info, scopes=list(SCOPES)
            )
            return creds, info.get("quota_project_id")
    except (ValueError, KeyError, TypeError) as exc:
        raise gauth_exc.DefaultCredentialsError(
            f"Failed to load {kind} credentials from {path}: {str(exc).splitlines()[0]}"
        ) from None
    raise gauth_exc.DefaultCredentialsError(
        f"its type is {kind!r}; a service_account or authorized_user file is needed"
    )


def _describe_default(credentials: Any) -> str:
    # Names the kind of credentials, never a key or a token.
    kind = type(credentials).__module__ + "." + type(credentials).__name__
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return "GOOGLE_APPLICATION_CREDENTIALS"
    if "compute_engine" in kind:
        return "instance service account"
    if "oauth2.credentials" in kind:
        return "application-default login"
    if "external_account" in kind or "identity_pool" in kind:
        return "workload identity federation"
    if "impersonated" in kind:
        return "impersonated service account"
    return type(credentials).__name__
