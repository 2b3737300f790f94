"""``redact``: the credentials of a URL in a message, log line or metrics event are
replaced by ``***`` however the URL was written (docs/storage.md)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sexpgpu.checkpoint.storage import redact
from tests.properties import budget


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        # a password with an "@" or a "/" its writer did not percent-encode
        (
            "cannot list http://user:p@ss@host:9000/b: refused",
            "cannot list http://***@host:9000/b: refused",
        ),
        ("endpoint https://user:pa/ss@host/b", "endpoint https://***@host/b"),
        ("endpoint https://user:a/b@c@host", "endpoint https://***@host"),
        ("'http://user:p@s/s@host:9000/b'", "'http://***@host:9000/b'"),
        # a URI with no scheme
        ("endpoint user:secret@localhost:9000 refused", "endpoint ***@localhost:9000 refused"),
        ("tracking user:p@ss/w@host:5000", "tracking ***@host:5000"),
        ('{"uri": "user:pw@host/x"}', '{"uri": "***@host/x"}'),
        ("(user:pw@host)", "(***@host)"),
        # an empty user, a token, two URLs
        ("http://:pw@h/x", "http://***@h/x"),
        ("https://tok@en@example.com/x", "https://***@example.com/x"),
        ("http://u:1@a and gs://v:2@b/k", "http://***@a and gs://***@b/k"),
    ],
)
def test_credentials_are_replaced_however_the_url_is_written(text: str, redacted: str) -> None:
    assert redact(text) == redacted


@pytest.mark.parametrize(
    "text",
    [
        "s3://bucket/runs/step-00000004",
        "http://host:9000/bucket",
        "https://example.com/users/@me",
        "mail john@example.com",
        "note: see x@y",
        "step 4: loss 2.5 at 12:30",
        "C:/runs/step-00000004",
    ],
)
def test_text_without_credentials_is_left_as_it_is(text: str) -> None:
    assert redact(text) == text


_USER = st.text(
    st.characters(codec="ascii", min_codepoint=33, blacklist_characters=":/@'\""), max_size=8
)
_PASSWORD = st.text(
    st.characters(codec="ascii", min_codepoint=33, blacklist_characters="'\""),
    min_size=1,
    max_size=16,
)
_HOST = st.from_regex(r"[a-z][a-z0-9.-]{0,12}(:[0-9]{1,5})?", fullmatch=True)
_WORD_STARTS = "(<=,;"
"""What may stand before a URI with no scheme: its user begins after them."""


@given(
    scheme=st.sampled_from(["http://", "https://", "s3://", "gs://", ""]),
    user=_USER,
    password=_PASSWORD,
    host=_HOST,
)
@example(scheme="https://", user="u", password="p@ss/w", host="h")
@budget(1000)
def test_no_password_survives(scheme: str, user: str, password: str, host: str) -> None:
    if not scheme:  # with no scheme, the user begins the word
        user = user.translate(dict.fromkeys(map(ord, _WORD_STARTS))) or "u"
    line = f"cannot reach '{scheme}{user}:{password}@{host}/bucket': refused"
    assert redact(line) == f"cannot reach '{scheme}***@{host}/bucket': refused"
