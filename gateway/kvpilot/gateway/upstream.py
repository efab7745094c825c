"""One request sent to one upstream (a replica or a provider) and its answer relayed to the client.

An answer is either relayed (`web.StreamResponse`, the client has it) or refused (`Refusal`: nothing
reached the client, so the proxy may try elsewhere). A non-streamed answer is read whole before the
client sees a byte, so a replica that dies mid-generation is retried; a stream is relayed byte for
byte (never re-encoded) once its first chunk arrived, an event at a time: an event is passed on
only once it is complete (its blank line arrived), so a failure after the first chunk ends the
stream with the complete events, then an SSE error event, never half an event the client could
not parse. A client that goes away ends the handler (aiohttp cancels it), which closes the
upstream connection, so the replica aborts the request and frees its KV cache.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvpilot.gateway.exchange import Tap, end_taps, through_taps

# Answers another replica may do better with: overloaded, draining, or a broken proxy hop.
RETRYABLE_STATUS = {429: "saturated", 502: "bad_gateway", 503: "unavailable"}
# Upstream headers worth passing on; hop-by-hop and length headers are the server's own.
PASSED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After", "X-Request-Id")
log = logging.getLogger(__name__)


@dataclass
class Refusal:
    """Nothing was sent to the client: why, and the upstream's answer if it gave one."""

    reason: str
    status: int | None = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Hop:
    """Where a request goes and what the response headers will say about it."""

    url: str
    backend: str  # x-kvpilot-backend
    target: str  # x-kvpilot-target
    headers: dict[str, str]  # sent upstream
    reply_headers: dict[str, str] = field(default_factory=dict)  # added to the client's response
    # Statuses worth another replica for this request beyond RETRYABLE_STATUS: a 404 for an
    # adapter a new replica has not loaded yet.
    also_retry: Mapping[int, str] = field(default_factory=dict)


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 413: "RequestTooLargeError", 429: "RateLimitError",
               503: "ServiceUnavailableError"}  # fmt: skip


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> bytes:
    kind = ERROR_TYPES.get(status, "APIError")
    error = {"message": message, "type": kind, "param": param, "code": code or status}
    return json.dumps({"error": error}).encode()


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    body = error_body(message, status, param, code)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def sse_error_event(message: str) -> bytes:
    """A clean end for a stream broken after its first byte: the error as one SSE event, then
    [DONE] (written after whole events only, so on an event boundary)."""
    error = json.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}})
    return f"data: {error}\n\ndata: [DONE]\n\n".encode()


EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # a blank line ends an SSE event


def split_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` cut after its last complete event, and the rest (an event still arriving)."""
    cut = max((data.rfind(end) + len(end) for end in EVENT_ENDS if end in data), default=0)
    return data[:cut], data[cut:]


def response_headers(upstream: aiohttp.ClientResponse, hop: Hop) -> dict[str, str]:
    headers = {name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers}
    return {**headers, **hop.reply_headers, "x-kvpilot-backend": hop.backend,
            "x-kvpilot-target": hop.target}  # fmt: skip


async def forward(
    session: aiohttp.ClientSession,
    request: web.Request,
    hop: Hop,
    body: bytes,
    stream: bool,
    on_first_byte: Callable[[], None],
    taps: Sequence[Tap] = (),
) -> web.StreamResponse | Refusal:
    """POST `body` to `hop`; the relayed response (through `taps`), or a Refusal when the
    client got nothing (the taps saw nothing either)."""
    try:
        async with session.post(hop.url, data=body, headers=hop.headers) as upstream:
            try:
                return await answer(request, upstream, hop, stream, on_first_byte, taps)
            finally:
                upstream.close()  # unread (client gone, or broken): never reuse this connection
    except (TimeoutError, aiohttp.ClientError, ConnectionResetError) as error:
        if request.transport is None or request.transport.is_closing():
            raise  # the client went away mid-relay: nothing to answer
        log.warning("upstream %s refused before the first byte: %r", hop.backend, error)
        return Refusal("connect" if isinstance(error, aiohttp.ClientConnectorError) else "broken")


async def answer(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    hop: Hop,
    stream: bool,
    on_first_byte: Callable[[], None],
    taps: Sequence[Tap],
) -> web.StreamResponse | Refusal:
    retryable = {**RETRYABLE_STATUS, **hop.also_retry}
    if upstream.status in retryable:
        headers = {n: upstream.headers[n] for n in PASSED_HEADERS if n in upstream.headers}
        return Refusal(retryable[upstream.status], upstream.status, await upstream.read(),
                       headers)  # fmt: skip
    if not stream or upstream.content_type != "text/event-stream":
        data = await upstream.read()
        on_first_byte()
        data = through_taps(taps, data) + end_taps(taps, complete=True)
        headers = response_headers(upstream, hop)
        return web.Response(status=upstream.status, body=data, headers=headers)
    first = await upstream.content.readany()
    if not first:
        return Refusal("broken")
    on_first_byte()
    return await relay(request, upstream, hop, first, taps)


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    hop: Hop,
    first: bytes,
    taps: Sequence[Tap],
) -> web.StreamResponse:
    """Relay the stream's events as they come; a stream that breaks, or ends without its
    `data: [DONE]`, gets an SSE error event and [DONE] so the client sees a clean end (an event
    it broke off in the middle of is dropped)."""
    response = web.StreamResponse(status=upstream.status, headers=response_headers(upstream, hop))
    await response.prepare(request)
    ended = False
    try:
        broken, tail, rest = await copy_events(upstream, response, first, taps)
        if not broken and b"data: [DONE]" not in tail:
            broken = "ended the stream early"
        if rest and not broken:  # an upstream that ended its last event without a blank line
            await response.write(through_taps(taps, rest))
        elif rest:
            log.warning("upstream %s broke off mid-event; dropped its %d bytes", hop.backend,
                        len(rest))  # fmt: skip
        ended = True
        await response.write(end_taps(taps, complete=not broken))
        if broken:
            await response.write(sse_error_event(f"the replica {hop.backend} {broken}; retry"))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away; closing the upstream connection aborts the request there
    finally:
        if not ended:  # the client went away (or the handler was cancelled) mid-stream
            end_taps(taps, complete=False)
    return response


async def copy_events(
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    first: bytes,
    taps: Sequence[Tap],
) -> tuple[str, bytes, bytes]:
    """Copy whole events until the upstream ends; why it broke ("" when it did not), the last
    bytes seen (to find `data: [DONE]`) and what came after the last whole event."""
    chunk, tail, rest = first, b"", b""
    while chunk:
        tail = (tail + chunk)[-32:]
        events, rest = split_events(rest + chunk)
        if events:
            await response.write(through_taps(taps, events))
        try:
            chunk = await upstream.content.readany()
        except (TimeoutError, aiohttp.ClientError) as error:
            return f"failed mid-stream ({type(error).__name__})", tail, rest
    return "", tail, rest
