"""What the storage backends behind checkpoint locations share: the error codes, URI
schemes and bucket locations, settings, and redacting credentials from messages. A
location is opened by the backend that serves its scheme
(:meth:`sexpgpu.catalog.Catalog.open_location`)."""

from __future__ import annotations

import os
import re

from sexpgpu.errors import StorageError

# The codes every storage backend raises its StorageErrors with (docs/errors.md).
NO_CREDENTIALS = "E-STORAGE-001"
ACCESS_DENIED = "E-STORAGE-002"
NO_SUCH_LOCATION = "E-STORAGE-003"
CANNOT_LIST = "E-STORAGE-004"
WRITE_FAILED = "E-STORAGE-005"
READ_FAILED = "E-STORAGE-006"
NOT_A_FILE = "E-STORAGE-007"

PROBE_PREFIX = ".sexpgpu-probe-"
"""Names of the objects ``check_writable`` writes and deletes; never listed as children."""

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


# The credentials of a URL in a message: after its scheme, a user and ":" then a
# password up to the word's last "@" (a password may hold an "@" or a "/" its
# writer did not percent-encode), or a user or token up to its last "@" before any
# "/". A host:port whose path holds an "@" is masked with it: more than the
# credentials, never less.
_CREDENTIALS_IN_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)(?:[^\s/:@]*:\S*|[^\s/]*)@")
# The same without a scheme (``user:secret@host:9000``), as a word of its own: a
# user, ":" (not the "://" of a scheme) and a password up to the word's last "@".
_CREDENTIALS_WITHOUT_SCHEME = re.compile(r"(?<![^\s'\"(<=,;])[^\s/:@'\"(<=,;]+:(?!//)\S*@")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``
    (``http://user:secret@host`` -> ``http://***@host``, ``user:secret@host`` ->
    ``***@host``), for messages, logs and metrics."""
    text = _CREDENTIALS_IN_URL.sub(r"\1***@", text)
    return _CREDENTIALS_WITHOUT_SCHEME.sub("***@", text)


def scheme_of(uri: str) -> str:
    """The URI scheme of a location; a plain path is ``file``."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else "file"


def split_bucket_uri(uri: str, scheme: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of a ``<scheme>://bucket/prefix``
    location; for storage backends of bucket stores."""
    marker = f"{scheme}://"
    rest = uri[len(marker) :] if uri.lower().startswith(marker) else uri
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        article = "an" if scheme[0] in "aeiosx" else "a"
        raise StorageError(
            f"{uri}: {article} {marker} location needs a bucket ({marker}bucket/prefix)"
        )
    return bucket, prefix.strip("/")


def int_setting(name: str, default: int, minimum: int) -> int:
    """An integer tuning setting from the environment variable ``name`` (``default``
    when unset); a value that is not an integer, or below ``minimum``, is an error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise StorageError(f"{name} must be an integer, not {raw!r}") from None
    if value < minimum:
        raise StorageError(f"{name} must be at least {minimum}, not {value}")
    return value
