"""What a request to no endpoint is told (api_errors.unknown_route)."""

from __future__ import annotations

import pytest

from kvpilot.runtime.server.errors import unknown_route

ROUTES = {
    "/v1/completions": {"POST"},
    "/v1/chat/completions": {"POST"},
    "/v1/models": {"GET"},
    "/health": {"GET"},
    "/tokenize": {"POST"},
}
ENDPOINTS = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models"


NOT_AN_ENDPOINT = "{} is not an endpoint of this server; its OpenAI endpoints: " + ENDPOINTS


@pytest.mark.parametrize(
    ("method", "path", "message"),
    [
        ("POST", "/v1/embeddings", NOT_AN_ENDPOINT.format("POST /v1/embeddings")),
        ("GET", "/v2/models", NOT_AN_ENDPOINT.format("GET /v2/models")),
        ("GET", "/v1/completions", "GET /v1/completions is not served; use POST /v1/completions"),
        ("DELETE", "/health", "DELETE /health is not served; use GET /health"),
    ],
)
def test_unknown_routes_name_what_to_call_instead(method: str, path: str, message: str) -> None:
    assert unknown_route(method, path, ROUTES) == message
