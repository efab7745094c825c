"""`ApiError` and its OpenAI-shaped JSON response, shared by the server's request handlers."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from fastapi.responses import JSONResponse

from kvpilot.runtime.server.response_models import error_body

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    503: "ServiceUnavailableError",
}
# OpenAI's `code` is a string (e.g. "model_not_found"): every error here has one, by status where
# nothing more specific applies, so a client can rely on its type.
ERROR_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
}
RETRY_AFTER_S = 1


def error_code(status: int) -> str:
    return ERROR_CODES.get(status, f"http_{status}")


class ApiError(Exception):
    """An answer other than 200: status, a message saying what to do, the field at fault.

    `code` is OpenAI's machine-readable code (e.g. "model_not_found"); the status's when unset.
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
        self.status, self.message, self.param = status, message, param
        self.code = code or error_code(status)
        default = "BadRequestError" if status < 500 else "InternalServerError"
        self.kind = kind or ERROR_TYPES.get(status, default)


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    extra = dict(headers or {})
    if error.status in (429, 503):
        extra.setdefault("Retry-After", str(RETRY_AFTER_S))
    body = error_body(error.message, error.kind, error.param, error.code)
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
