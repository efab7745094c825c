"""What the client gets when no replica or fallback answered."""

from __future__ import annotations

import json

import pytest

from kvpilot.gateway.proxy import Outcome, refused_response
from kvpilot.gateway.upstream import Refusal

SATURATED = Refusal("saturated", 429, b'{"error": {"message": "busy"}}', {"Retry-After": "2"})


@pytest.mark.parametrize(
    ("outcome", "status", "retry_after", "says"),
    [
        (Outcome(reason="saturated", refusal=SATURATED), 429, "2", "busy"),  # as the replica said
        (Outcome(reason="hold_queue_full"), 429, "1", "too many requests are waiting"),
        (Outcome(reason="hold_timeout"), 503, "1", "(hold_timeout)"),
        (Outcome(reason="connect", refusal=Refusal("connect")), 503, "1", "(connect)"),
        (Outcome(reason="tenant_queue_full"), 429, "1", "--max-queued-per-tenant"),
        (Outcome(reason="queue_timeout"), 429, "1", "waited longer than --fallback-after"),
    ],
)
def test_refused_response(outcome: Outcome, status: int, retry_after: str, says: str) -> None:
    response = refused_response(outcome, "tiny")
    assert response.status == status
    assert response.headers["Retry-After"] == retry_after
    assert response.body is not None
    assert says in json.loads(bytes(response.body))["error"]["message"]  # type: ignore[arg-type]
