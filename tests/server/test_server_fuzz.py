"""Fuzz every endpoint from the server's own OpenAPI schema: no input may produce a 5xx.

Drives schemathesis' strategies with hypothesis directly: its lazy pytest loader
(`schemathesis.pytest.from_fixture`) reads a private pytest attribute that pytest 9 removed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

MAX_EXAMPLES = 60  # per operation and mode; each valid request runs the real engine on 2 cores


@pytest.fixture(scope="module")
def fuzz_server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    # a short context bounds how long any generated request can generate for
    return start_server("--max-model-len", "96", "--max-num-seqs", "4")


def operations(url: str) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"invalid OpenAPI operation: {result}"
        ops.append(result.ok())
    return ops


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode) -> set[int]:
    statuses: set[int] = set()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    def call(case: schemathesis.Case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = MODEL  # a random model name would stop every request at a 400
        response = case.call(timeout=120)
        statuses.add(response.status_code)
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where}: {response.text[:500]}"
        if response.status_code >= 400 and case.method.upper() == "POST":
            assert "message" in response.json()["error"], where

    call()
    return statuses


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_produces_a_server_error(fuzz_server: RuntimeServer, mode: GenerationMode) -> None:
    ops = operations(fuzz_server.url)
    posts = {op.path for op in ops if op.method.upper() == "POST"}
    assert posts == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for operation in ops:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break in a GET without parameters
        statuses = fuzz(operation, mode)
        if operation.method.upper() == "POST" and mode is GenerationMode.POSITIVE:
            assert 200 in statuses, operation.path  # the fuzzer reached the engine
        if mode is GenerationMode.NEGATIVE:
            assert 400 in statuses, operation.path
