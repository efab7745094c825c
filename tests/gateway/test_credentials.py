"""Credentials at the gateway's edge, pure (issue 40): the bearer token in any case of the scheme,
the cache scope of a caller (its credential, key, team or everyone), and the reason a malformed
request is refused with, never quoting its bytes."""

from __future__ import annotations

import pytest
from aiohttp.http_exceptions import BadHttpMessage, InvalidHeader, LineTooLong

from kvpilot.gateway.cache.scope import Who, scope_of
from kvpilot.gateway.credentials import bearer_token, credential_digest
from kvpilot.gateway.edge import reason_of


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer sk-1", "sk-1"),  # RFC 7235: the scheme is case-insensitive
        ("BEARER   sk-1 ", "sk-1"),
        ("Basic c2stMQ==", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("sk-1", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_a_credential_is_named_by_a_hash_of_its_token() -> None:
    assert credential_digest("Bearer sk-1") == credential_digest("bearer sk-1")
    assert credential_digest("Bearer sk-1") != credential_digest("Bearer sk-2")
    assert credential_digest("Bearer sk-1") != credential_digest("sk-1")  # the replica refuses it
    assert "sk-1" not in credential_digest("Bearer sk-1")
    assert credential_digest(None) == credential_digest("") == ""


JUDGED = "credential:" + credential_digest("Bearer sk-a")


@pytest.mark.parametrize(
    ("setting", "who", "scope"),
    [
        # no gateway keys, the replica checks the client's key: the credential, whatever the setting
        ("team", Who(None, "", "Bearer sk-a", True), JUDGED),
        ("shared", Who(None, "", "bearer sk-a", True), JUDGED),
        ("shared", Who(None, "", None, True), "anonymous"),
        # no gateway keys, the gateway sends its own upstream key: everyone is answered alike
        ("team", Who(None, "", "Bearer sk-a", False), "shared"),
        # gateway keys: by cache.scope
        ("team", Who("k1", "research", "Bearer sk-a"), "team:research"),
        ("team", Who("k1", "", "Bearer sk-a"), "key:k1"),  # a key without a team: its own
        ("key", Who("k1", "research", "Bearer sk-a"), "key:k1"),
        ("shared", Who("k1", "research", "Bearer sk-a"), "shared"),
    ],
)
def test_the_cache_scope_of_a_caller(setting: str, who: Who, scope: str) -> None:
    assert scope_of(setting, who) == scope


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (BadHttpMessage("Missing expected CR after header value:\n\n  b'Authorization: Bearer "
                        "sk-1\\nX: y'\n  ^"), "Missing expected CR after header value"),
        (InvalidHeader(b"Authorization: Bearer sk-1"), "the request is not valid HTTP/1.1"),
        (LineTooLong("Status line is too long", "8190", "9000"),
         "a line of the request's head is too long"),
        (BadHttpMessage(""), "the request is not valid HTTP/1.1"),
    ],
)  # fmt: skip
def test_a_malformed_requests_reason_never_quotes_it(error: BadHttpMessage, reason: str) -> None:
    assert reason_of(error) == reason
    assert "sk-1" not in reason_of(error)
