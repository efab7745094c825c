"""A request aiohttp cannot parse (a header with a bare line feed, a line too long, a bad method):
a 400 in the OpenAI error shape and one log line, neither quoting the request.

aiohttp answers such a request itself, before any handler or middleware runs: its protocol's
`handle_error` logs a traceback and sends the parser's message, which quotes the offending bytes
(`b'Authorization: Bearer sk-...\\nX-Injected: yes'`), so anyone could fill the log and have a
key echoed. aiohttp has no setting for that class, so `GatewayRunner` makes the server build
`EdgeProtocol`s, which answer these requests without the bytes.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvpilot.gateway.upstream import error_response

access_log = logging.getLogger("kvpilot.gateway.access")
MAX_REASON_CHARS = 80


def reason_of(exc: HttpProcessingError) -> str:
    """The parser's reason without the request's bytes: the first line of its message (llhttp's
    fixed text, e.g. `Missing expected CR after header value`), or a generic one when that line
    quotes anything."""
    if isinstance(exc, LineTooLong):
        return "a line of the request's head is too long"
    first = str(exc.message).split("\n", 1)[0].strip().rstrip(":")
    if not first or len(first) > MAX_REASON_CHARS or any(q in first for q in "'\"`\\"):
        return "the request is not valid HTTP/1.1"
    return first


class EdgeProtocol(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        reason = reason_of(exc)
        line = {"event": "malformed_request", "remote": request.remote, "status": 400,
                "reason": reason}  # fmt: skip
        access_log.info(json.dumps(line))
        text = (f"malformed HTTP request: {reason}; send valid HTTP/1.1 (each header on a line "
                "of its own ending with CRLF, no control character in a value)")  # fmt: skip
        response = error_response(400, text, None, "malformed_request")
        response.force_close()
        return response


class EdgeServer(web.Server):
    def __call__(self) -> RequestHandler:
        return EdgeProtocol(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections are `EdgeProtocol`s."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = EdgeServer  # same state; only the protocol it builds differs
        return server
