"""Limits that keep one request from stalling the server: body size and upload time, and prompt
length in characters before any tokenisation.

`BodySizeLimit` is ASGI middleware: a declared Content-Length over the limit is answered 413
before a byte of the body is read, and a chunked body is counted while it arrives and refused as
soon as it passes the limit, so at most the limit plus one chunk is ever held. uvicorn stops
reading the socket while the app is not consuming (flow control), so a slow upload costs nothing.

`BodyReadTimeout` bounds the time a body takes to arrive: uvicorn has no such timeout, so a
client that sends headers and then stalls (or drips a byte now and then) would hold its
connection, and a file descriptor, for ever. Past the deadline the request is answered 408 and the
connection closed. The deadline counts from the headers to the body's last byte, not between
reads, so a drip cannot extend it.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.runtime.server.errors import ApiError, error_response


def too_large_message(max_bytes: int) -> str:
    return (
        f"request body is larger than this server's limit of {max_bytes} bytes "
        "(--max-request-body-bytes); send a shorter prompt"
    )


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses a malformed length before we get here
    return None


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            response = error_response(ApiError(413, too_large_message(self.max_bytes)))
            await response(scope, receive, send)
            return
        await self.app(scope, self.counting(receive), send)

    def counting(self, receive: Receive) -> Receive:
        num_received = 0

        async def receive_within_limit() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    # FastAPI lets an HTTPException raised while reading the body through to
                    # the app's handler, which answers it as an OpenAI-shaped 413
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        return receive_within_limit


def too_slow_message(timeout_s: float) -> str:
    return (
        f"request body did not arrive within this server's limit of {timeout_s:g} s "
        "(--request-body-timeout); send the whole body at once"
    )


class BodyReadTimeout:
    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, self.in_time(receive), send)

    def in_time(self, receive: Receive) -> Receive:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        is_body_read = False

        async def receive_in_time() -> Message:
            nonlocal is_body_read
            if is_body_read:  # later receives wait for a disconnect, as long as a response runs
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                # answered by the app's handler like the 413 above; the connection is closed
                # after it, since the rest of the body may still come
                headers = {"Connection": "close"}
                raise HTTPException(408, too_slow_message(self.timeout_s), headers) from None
            is_body_read = message["type"] != "http.request" or not message.get("more_body")
            return message

        return receive_in_time


def check_num_chars(
    num_chars: int, field: str, max_model_len: int, max_chars_per_token: int
) -> None:
    """400 for text that cannot fit in the context whatever it tokenises to, before tokenising.

    No token stands for more than `max_chars_per_token` characters (models/tokenizer_files.py), so a
    text of more than max_model_len × that many characters needs more tokens than the model can
    take.
    """
    max_chars = max_model_len * max_chars_per_token
    if num_chars > max_chars:
        raise ApiError(
            400,
            f"{field}: {num_chars} characters cannot fit in this model's maximum context length "
            f"of {max_model_len} tokens (a token of its vocabulary stands for at most "
            f"{max_chars_per_token} characters, so at most {max_chars} characters fit); "
            "send a shorter prompt",
            field,
        )
