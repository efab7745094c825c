"""`ApiError` and its OpenAI-shaped JSON response, shared by the server's request handlers."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from fastapi.responses import JSONResponse

from kvpilot.runtime.server.response_models import error_body

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An answer other than 200: status, a message saying what to do, the field at fault.

    `code` is OpenAI's machine-readable code (e.g. "model_not_found"); the status when unset.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        default = "BadRequestError" if status < 500 else "InternalServerError"
        self.kind = kind or ERROR_TYPES.get(status, default)


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    extra = dict(headers or {})
    if error.status in (429, 503):
        extra.setdefault("Retry-After", str(RETRY_AFTER_S))
    body = error_body(error.message, error.kind, error.param, error.code or error.status)
    return JSONResponse(body, status_code=error.status, headers=extra)


def unknown_route(method: str, path: str, routes: Mapping[str, Collection[str]]) -> str:
    """What a request that matches no endpoint is told (`routes`: path -> its methods): the
    method to use where the path exists, else the endpoints this server has, so a client aimed
    at an API it lacks (/v1/embeddings, /v1/responses) learns what it can call instead."""
    methods = routes.get(path)
    if methods:
        return f"{method} {path} is not served; use {' or '.join(sorted(methods))} {path}"
    endpoints = ", ".join(
        f"{m} {p}" for p, ms in sorted(routes.items()) if p.startswith("/v1/") for m in sorted(ms)
    )
    return f"{method} {path} is not an endpoint of this server; its OpenAI endpoints: {endpoints}"
