"""What a request to no endpoint of the gateway is told (unknown_routes.unknown_route)."""

from __future__ import annotations

import pytest

from kvpilot.gateway.unknown_routes import unknown_route

ROUTES = {
    "/v1/completions": {"POST"},
    "/v1/chat/completions": {"POST"},
    "/v1/models": {"GET"},
    "/metrics": {"GET"},
}
NOT_AN_ENDPOINT = (
    "{} is not an endpoint of this gateway; its OpenAI endpoints: "
    "POST /v1/chat/completions, POST /v1/completions, GET /v1/models"
)


@pytest.mark.parametrize(
    ("method", "path", "message"),
    [
        ("POST", "/v1/responses", NOT_AN_ENDPOINT.format("POST /v1/responses")),
        ("GET", "/", NOT_AN_ENDPOINT.format("GET /")),
        ("GET", "/v1/completions", "GET /v1/completions is not served; use POST /v1/completions"),
        ("POST", "/metrics", "POST /metrics is not served; use GET /metrics"),
    ],
)
def test_unknown_routes_name_what_to_call_instead(method: str, path: str, message: str) -> None:
    assert unknown_route(method, path, ROUTES) == message
