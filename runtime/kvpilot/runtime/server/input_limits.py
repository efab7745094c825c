"""Limits that keep one request from stalling the server: body size, and prompt length in
characters before any tokenisation.

`BodySizeLimit` is ASGI middleware: a declared Content-Length over the limit is answered 413
before a byte of the body is read, and a chunked body is counted while it arrives and refused as
soon as it passes the limit, so at most the limit plus one chunk is ever held. uvicorn stops
reading the socket while the app is not consuming (flow control), so a slow upload costs nothing.
"""

from __future__ import annotations

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
