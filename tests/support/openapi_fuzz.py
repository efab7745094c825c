"""Fuzzing an HTTP server from an OpenAPI document: schemathesis' strategies driven by hypothesis
directly (its lazy pytest loader, `schemathesis.pytest.from_fixture`, reads a private pytest
attribute that pytest 9 removed). Used for the runtime (tests/server/test_server_fuzz.py) and for
the gateway in front of it (tests/gateway/test_gateway_fuzz.py), whose paths the runtime's
document describes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok


def operations(url: str) -> list[schemathesis.APIOperation]:
    """Every operation of the document the server at `url` serves at /openapi.json."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"invalid OpenAPI operation: {result}"
        ops.append(result.ok())
    return ops


def no_server_error(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    max_examples: int,
    valid_body: Callable[[dict[str, Any]], None],
    **call: Any,
) -> set[int]:
    """Sends `max_examples` generated requests (`case.call(**call)`: base_url, headers) and
    asserts none is a 5xx and every refused POST says why; returns the statuses seen. A positive
    (valid) body is passed through `valid_body` first, which may edit it, e.g. to name the served
    model (a random name would stop every request at its first check)."""
    statuses: set[int] = set()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    def send(case: schemathesis.Case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            valid_body(case.body)
        response = case.call(timeout=120, **call)
        statuses.add(response.status_code)
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where}: {response.text[:500]}"
        if response.status_code >= 400 and case.method.upper() == "POST":
            assert "message" in response.json()["error"], where

    send()
    return statuses
