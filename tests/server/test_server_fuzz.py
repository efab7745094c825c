"""Fuzz every endpoint from the server's own OpenAPI schema: no input may produce a 5xx
(tests/support/openapi_fuzz.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from schemathesis import GenerationMode

from tests.support.openapi_fuzz import no_server_error, operations
from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

MAX_EXAMPLES = 60  # per operation and mode; each valid request runs the real engine on 2 cores


@pytest.fixture(scope="module")
def fuzz_server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    # a short context bounds how long any generated request can generate for
    return start_server("--max-model-len", "96", "--max-num-seqs", "4")


def named_model(body: dict[str, Any]) -> None:
    body["model"] = MODEL  # a random model name would stop every request at a 400


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_produces_a_server_error(fuzz_server: RuntimeServer, mode: GenerationMode) -> None:
    ops = operations(fuzz_server.url)
    posts = {op.path for op in ops if op.method.upper() == "POST"}
    assert posts == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for operation in ops:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break in a GET without parameters
        statuses = no_server_error(
            operation, mode, MAX_EXAMPLES, named_model, base_url=fuzz_server.url
        )
        if operation.method.upper() == "POST" and mode is GenerationMode.POSITIVE:
            assert 200 in statuses, operation.path  # the fuzzer reached the engine
        if mode is GenerationMode.NEGATIVE:
            assert 400 in statuses, operation.path
