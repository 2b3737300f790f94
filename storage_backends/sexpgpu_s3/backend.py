"""A checkpoint location in S3: concurrent multipart uploads, ranged reads, ETag identity.

Configuration is boto3's own (credential chain, profiles, ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``, region), plus ``SEXPGPU_CHECKPOINT_PROFILE`` to use a
separate profile for checkpoints and a few tuning variables (docs/environment.md).
"""

from __future__ import annotations

import base64
import math
import os
import secrets
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import boto3
import botocore.exceptions as bexc
import google_crc32c
from botocore.config import Config

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

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest part but the last
MAX_PARTS = 10_000

MULTIPART_SUFFIX = ".safetensors"
"""Objects whose name ends so (a checkpoint's tensor files) always go up as multipart
uploads, in one part when small, as the checkpoint spec has them; others only
when larger than the part size."""

_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
_REJECTED = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "InvalidClientTokenId",
    "TokenRefreshRequired",
    "UnrecognizedClientException",
}
_MISSING_OBJECT = {"NoSuchKey", "404", "NotFound"}

_METHODS = {
    "env": "environment",
    "iam-role": "instance role",
    "container-role": "container role",
    "assume-role-with-web-identity": "web identity role",
    "explicit": "explicit keys",
}


def _crc32c(data: bytes) -> str:
    """CRC32C of ``data`` as S3 writes it: base64 of the 4 big-endian bytes."""
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


def _multipart_checksum(key: str, crc32c: Mapping[str, str]) -> dict[str, str]:
    if key in crc32c:
        return {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"}
    return {"ChecksumAlgorithm": "CRC32"}


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of a ``s3://`` URI."""
    return split_bucket_uri(uri, "s3")


class S3Storage(Storage):
    """An ``s3://bucket/prefix`` location opened with the checkpoint credentials."""

    takes_crc32c = True  # S3 verifies each upload against its ChecksumCRC32C

    def __init__(self, uri: str) -> None:
        self.bucket, self.prefix = split_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.profile = os.environ.get("SEXPGPU_CHECKPOINT_PROFILE", "").strip() or None
        self.part_size = int_setting("SEXPGPU_S3_PART_SIZE_MB", 8, 5) * MIB
        self.concurrency = int_setting("SEXPGPU_S3_CONCURRENCY", 10, 1)
        self.max_attempts = int_setting("SEXPGPU_S3_MAX_ATTEMPTS", 5, 1)
        self._lock = threading.RLock()
        self._session: Any = None
        self._client: Any = None
        self._source: str | None = None

    # -- session and client, made on first use

    def _get_session(self) -> Any:
        with self._lock:
            return self._make_session()

    def _make_session(self) -> Any:
        if self._session is None:
            try:
                self._session = boto3.session.Session(profile_name=self.profile)
            except bexc.ProfileNotFound:
                raise StorageError(
                    f"cannot open {self.uri}: the AWS profile '{self.profile}' named by "
                    "SEXPGPU_CHECKPOINT_PROFILE is not in the AWS config or credentials files",
                    code=NO_CREDENTIALS,
                ) from None
        return self._session

    @property
    def client(self) -> Any:
        """The boto3 S3 client (thread-safe; one per location)."""
        with self._lock:
            if self._client is None:
                config = Config(
                    retries={"mode": "standard", "max_attempts": self.max_attempts},
                    max_pool_connections=self.concurrency + 4,
                    connect_timeout=10,
                    read_timeout=60,
                )
                # The endpoint comes from AWS_ENDPOINT_URL(_S3) or the profile's
                # endpoint_url, which botocore reads itself.
                self._client = self._get_session().client("s3", config=config)
            return self._client

    def credential_source(self) -> str:
        """Where the credentials come from, in words (never the credentials)."""
        # Resolved once: error paths on upload threads ask for it concurrently.
        with self._lock:
            if self._source is None:
                self._source = self._resolve_source()
            return self._source

    def _resolve_source(self) -> str:
        try:
            session = self._get_session()
            credentials = session.get_credentials()
        except StorageError:
            return f"profile {self.profile} (missing)"
        except Exception:  # a broken credential provider: say so, without its details
            return "unreadable credentials"
        if credentials is None:
            return "none found"
        method = getattr(credentials, "method", None) or "unknown"
        profile = session.profile_name or "default"
        if method in ("shared-credentials-file", "config-file"):
            return f"profile {profile}"
        if method == "assume-role":
            return f"role assumed by profile {profile}"
        if method in ("sso", "login"):
            return f"SSO of profile {profile}"
        if method == "custom-process":
            return f"credential_process of profile {profile}"
        return _METHODS.get(method, method)

    def _key(self, key: str) -> str:
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
        where = self._where(key)
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
            looked = f"profile {self.profile}" if self.profile else "the default chain"
            return StorageError(
                f"no S3 credentials for {doing} {where} (looked in {looked}: environment, "
                "AWS_PROFILE, shared config and credentials files, container and instance "
                "roles)",
                code=NO_CREDENTIALS,
            )
        source = self.credential_source()
        if isinstance(exc, bexc.ClientError):
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            name = str(error.get("Code") or status or "error")
            if name in _REJECTED:
                return StorageError(
                    f"access denied {doing} {where}: the credentials ({source}) were "
                    f"not accepted ({name})",
                    code=ACCESS_DENIED,
                )
            if name in _DENIED or status == 403:
                return StorageError(
                    f"access denied {doing} {where} (credentials: {source})", code=ACCESS_DENIED
                )
            if name == "NoSuchBucket":
                return StorageError(
                    f"no such bucket {self.bucket} {doing} {where} (credentials: {source})",
                    code=NO_SUCH_LOCATION,
                )
            if name in _MISSING_OBJECT:
                return StorageError(f"{where} does not exist", code=NO_SUCH_LOCATION)
            message = " ".join(str(error.get("Message") or "").split())
            detail = f"{name}: {message}" if message else name
            return StorageError(
                f"{doing} {where} failed: {detail} (credentials: {source})", code=code
            )
        if isinstance(exc, bexc.BotoCoreError):
            detail = " ".join(str(exc).split())
            return StorageError(
                f"{doing} {where} failed after {self.max_attempts} attempts: {detail}", code=code
            )
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return StorageError(f"{doing} {where} failed: {detail}", code=code)

    # -- Storage

    def describe(self) -> str:
        """The location, the credential source and a non-default endpoint."""
        text = f"{self.uri} (credentials: {self.credential_source()}"
        try:
            endpoint = self.client.meta.endpoint_url
        except Exception:
            endpoint = None
        if endpoint and "amazonaws.com" not in endpoint:
            text += f", endpoint {redact(endpoint)}"
        return text + ")"

    def check_writable(self) -> None:
        """List the prefix, put a small probe object and delete it."""
        try:
            self._get_session()
            if self._get_session().get_credentials() is None:
                raise bexc.NoCredentialsError()
            self.client.list_objects_v2(
                Bucket=self.bucket, Prefix=self._key("") + "/" if self.prefix else "", MaxKeys=1
            )
        except Exception as exc:
            raise self._error(exc, "listing", "", CANNOT_LIST) from None
        probe = PROBE_PREFIX + secrets.token_hex(6)
        self.write(probe, b"sexpgpu write probe\n")
        self.delete(probe)

    def list_children(self, prefix: str = "") -> list[str]:
        """Names of objects and common prefixes one level under ``prefix``, every page."""
        full = self._key(prefix)
        full = full + "/" if full else ""
        names: set[str] = set()
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    names.add(common["Prefix"][len(full) :].rstrip("/"))
                for obj in page.get("Contents", []):
                    names.add(obj["Key"][len(full) :])
        except Exception as exc:
            raise self._error(exc, "listing", prefix, CANNOT_LIST) from None
        return sorted(n for n in names if n and not n.startswith(PROBE_PREFIX))

    def exists(self, key: str) -> bool:
        """Whether an object is at ``key`` (a HEAD request)."""
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except bexc.ClientError as exc:
            error = exc.response.get("Error", {})
            if str(error.get("Code")) in _MISSING_OBJECT:
                return False
            raise self._error(exc, "reading", key, READ_FAILED) from None
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None
        return True

    def read(self, key: str) -> bytes:
        """The whole object."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return response["Body"].read()
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """A Range GET of ``length`` bytes from ``start``; fewer at the end of the object."""
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        if length == 0:
            return b""
        try:
            response = self.client.get_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Range=f"bytes={start}-{start + length - 1}",
            )
            return response["Body"].read()
        except bexc.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # start at or past the end
            raise self._error(exc, "reading", key, READ_FAILED) from None
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None

    def write(self, key: str, data: bytes | memoryview) -> None:
        """One object: concurrent multipart parts when large or a tensor file
        (:data:`MULTIPART_SUFFIX`), a single PUT otherwise."""
        self.write_many({key: data})

    def write_many(
        self,
        items: Mapping[str, bytes | memoryview],
        crc32c: Mapping[str, str] | None = None,
    ) -> None:
        """Every object and every part of the large ones share one pool of uploads.

        A tensor file (``*.safetensors``) and any object larger than the part size go
        up as a multipart upload (one part for a small tensor file); the others as a
        single PUT. An object is visible only once its PUT or CompleteMultipartUpload
        succeeds, so each object is all or nothing; a failed multipart upload is aborted.
        ``crc32c`` maps a key to its object's CRC32C (base64, as S3 writes it): S3
        verifies it and refuses the upload when the bytes it got differ. A multipart
        upload sends each part's CRC32C and the whole object's (``FULL_OBJECT``).
        """
        crc32c = crc32c or {}
        if not items:
            return
        for key in items:
            if not key.strip("/"):
                raise StorageError(f"{self.uri}: cannot write an object without a name")
        views = {key: memoryview(data).cast("B") for key, data in items.items()}
        workers = min(self.concurrency, sum(self._parts_count(len(v)) for v in views.values()))
        failures: list[StorageError] = []
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            singles: list[Future] = []
            uploads: list[tuple[str, str, list[Future]]] = []
            for key, view in views.items():
                if not self._multipart(key, len(view)):
                    singles.append(pool.submit(self._put, key, view, crc32c.get(key)))
                    continue
                try:
                    upload_id = self.client.create_multipart_upload(
                        Bucket=self.bucket, Key=self._key(key), **_multipart_checksum(key, crc32c)
                    )["UploadId"]
                except Exception as exc:
                    failures.append(self._error(exc, "writing", key, WRITE_FAILED))
                    continue
                size = self._part_size(len(view))
                parts = [
                    pool.submit(
                        self._upload_part,
                        key,
                        upload_id,
                        n + 1,
                        view[a : a + size],
                        key in crc32c,
                    )
                    for n, a in enumerate(range(0, len(view), size))
                ]
                uploads.append((key, upload_id, parts))
            wait(singles + [f for _, _, parts in uploads for f in parts])
            for future in singles:
                if future.exception() is not None:
                    failures.append(future.exception())
            for key, upload_id, parts in uploads:
                error = self._complete(key, upload_id, parts, crc32c.get(key))
                if error is not None:
                    failures.append(error)
        if failures:
            raise failures[0]

    def _complete(
        self, key: str, upload_id: str, parts: list[Future], crc32c: str | None
    ) -> StorageError | None:
        """Complete the multipart upload of ``key`` once its parts are sent, or abort it
        when a part or the completion failed; returns the first failure."""
        errors = [f.exception() for f in parts if f.exception() is not None]
        if not errors:
            checksum = {"ChecksumCRC32C": crc32c, "ChecksumType": "FULL_OBJECT"} if crc32c else {}
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    UploadId=upload_id,
                    MultipartUpload={"Parts": [f.result() for f in parts]},
                    **checksum,
                )
                return None
            except Exception as exc:
                errors.append(self._error(exc, "writing", key, WRITE_FAILED))
        try:  # parts of an abandoned upload are billed until aborted
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id
            )
        except Exception:
            pass
        return errors[0]

    def _multipart(self, key: str, size: int) -> bool:
        # An empty object has no part to send: a PUT, whatever its name.
        tensors = key.endswith(MULTIPART_SUFFIX) and size > 0
        return tensors or self._parts_count(size) > 1

    def _part_size(self, size: int) -> int:
        return max(self.part_size, math.ceil(size / MAX_PARTS))

    def _parts_count(self, size: int) -> int:
        return max(1, math.ceil(size / self._part_size(size))) if size > self.part_size else 1

    def _put(self, key: str, view: memoryview, crc32c: str | None = None) -> None:
        checksum = {"ChecksumCRC32C": crc32c} if crc32c else {}
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=view.tobytes(), **checksum
            )
        except Exception as exc:
            raise self._error(exc, "writing", key, WRITE_FAILED) from None

    def _upload_part(
        self, key: str, upload_id: str, number: int, view: memoryview, crc32c: bool = False
    ) -> dict:
        body = view.tobytes()
        # botocore computes CRC32C only with awscrt installed; the part's bytes are here.
        checksum = {"ChecksumCRC32C": _crc32c(body)} if crc32c else {"ChecksumAlgorithm": "CRC32"}
        try:
            response = self.client.upload_part(
                Bucket=self.bucket,
                Key=self._key(key),
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                **checksum,
            )
        except Exception as exc:
            raise self._error(exc, "writing", key, WRITE_FAILED) from None
        part = {"PartNumber": number, "ETag": response["ETag"]}
        for name in ("ChecksumCRC32", "ChecksumCRC32C"):
            if name in response:
                part[name] = response[name]
        return part

    def delete(self, key: str) -> None:
        """DELETE the object; S3 answers the same whether it was there or not."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            raise self._error(exc, "deleting", key, WRITE_FAILED) from None

    def identity(self, key: str) -> ObjectIdentity:
        """Size and ETag (with its quotes, as S3 sends it) from a HEAD request."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            raise self._error(exc, "reading", key, READ_FAILED) from None
        return ObjectIdentity(size=int(head["ContentLength"]), version=str(head["ETag"]))
