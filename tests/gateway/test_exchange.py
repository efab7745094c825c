"""The policy seam's taps: what the client gets when taps filter and hold back bytes."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from kvpilot.gateway.bodies import COMPLETIONS, Inbound
from kvpilot.gateway.budget.config import KeyEntry
from kvpilot.gateway.budget.keys import CALLER, Caller
from kvpilot.gateway.exchange import Exchange, Tap, end_taps, through_taps
from kvpilot.gateway.proxy import authorization_for_replicas


class HoldLastLine:
    """Holds back bytes after the last newline (a filter that waits for whole events)."""

    def __init__(self) -> None:
        self.held: bytes = b""
        self.ended: bool | None = None

    def chunk(self, data: bytes) -> bytes:
        data, self.held = self.held + data, b""
        cut = data.rfind(b"\n") + 1
        data, self.held = data[:cut], data[cut:]
        return data

    def end(self, complete: bool) -> bytes:
        self.ended = complete
        held, self.held = self.held, b""
        return held


class Upper:
    def __init__(self) -> None:
        self.seen = b""

    def chunk(self, data: bytes) -> bytes:
        self.seen += data
        return data.upper()

    def end(self, complete: bool) -> bytes:
        return b"!" if complete else b""


@pytest.mark.parametrize(
    ("chunks", "complete", "client"),
    [
        ([b"a\nb", b"c\n"], True, b"A\nBC\n!"),
        ([b"a\nb"], False, b"A\nB"),  # held bytes pass the later tap when released
        ([], True, b"!"),
    ],
)
def test_taps_filter_in_order_and_release_what_they_held(
    chunks: list[bytes], complete: bool, client: bytes
) -> None:
    hold, upper = HoldLastLine(), Upper()
    taps: list[Tap] = [hold, upper]
    out = b"".join(through_taps(taps, chunk) for chunk in chunks) + end_taps(taps, complete)
    assert out == client
    assert hold.ended is complete
    assert upper.seen == b"".join(chunks)


@pytest.mark.parametrize(
    ("headers", "authenticated", "own_key", "sent"),
    [
        ({"Authorization": "Bearer sk-client"}, False, None, "Bearer sk-client"),  # checked there
        ({"Authorization": "bearer sk-client"}, False, None, "bearer sk-client"),  # as it came
        ({"Authorization": "Bearer sk-gateway"}, True, None, None),  # the gateway's own key
        ({}, False, None, None),
        ({"Authorization": "Bearer sk-gateway"}, True, "sk-up", "Bearer sk-up"),  # keys + --api-key
        ({"Authorization": "Bearer sk-client"}, False, "sk-up", "Bearer sk-up"),
        ({}, False, "sk-up", "Bearer sk-up"),
    ],
)  # fmt: skip
def test_what_authorization_reaches_replicas(
    headers: dict[str, str], authenticated: bool, own_key: str | None, sent: str | None
) -> None:
    request = make_mocked_request("POST", "/v1/completions", headers=headers)
    if authenticated:
        request[CALLER] = Caller("k1", "team", KeyEntry("k1", "team", None, ()))
    inbound = Inbound("m", False, "", {"model": "m"})
    exchange = Exchange(request, COMPLETIONS, inbound, b"{}", "m")
    assert authorization_for_replicas(exchange, own_key) == sent
