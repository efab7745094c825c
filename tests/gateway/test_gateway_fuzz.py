"""Fuzz the gateway from the runtime's own OpenAPI schema (issue 40, done-criterion: no 5xx).

The gateway proxies the runtime's `/v1/completions`, `/v1/chat/completions`, `/v1/models` and
`/health`, so the replica's `GET /openapi.json` describes them; every generated request goes to
the real gateway process of tests/gateway/conftest.py, in front of real tiny-llama replicas
(with the replicas' API key, which a gateway without keys passes on), and to a gateway with keys
and budgets in front of the same replicas (its key is its own and goes no further; it sends the
replicas theirs, `upstream.apiKeyEnv`), so valid requests are reserved, served and settled.
Driven as tests/server/test_server_fuzz.py drives the runtime (tests/support/openapi_fuzz.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from tests.gateway.conftest import API_KEY
from tests.support.gateway_process import GatewayProcess
from tests.support.openapi_fuzz import no_server_error, operations
from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime and gateway processes

# Per operation and mode: bounded, well under a minute on 2 loaded cores; a longer hunt:
# KVPILOT_GATEWAY_FUZZ_EXAMPLES=300.
MAX_EXAMPLES = int(os.environ.get("KVPILOT_GATEWAY_FUZZ_EXAMPLES", "15"))
GATEWAY_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
# A valid request's generation is bounded (the replicas' context is 2048 tokens): the fuzz is of
# the gateway's handling, not of how long tiny-llama can write.
MOST_TOKENS = 8
MOST_CHOICES = 2
GATEWAY_KEY = "sk-fuzz-budget"


@pytest.fixture(scope="module")
def keyed_gateway(
    replicas: list[RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    limits = [{"unit": "total_tokens", "limit": 10_000_000, "window": "1h"},
              {"unit": "cost", "limit": 1000, "window": "1h"}]  # fmt: skip
    config = {
        "models": [{"name": MODEL, "backends": [r.url for r in replicas]}],
        "keys": [{"key": GATEWAY_KEY, "limits": limits}],
        "prices": {MODEL: {"inputPerMillion": 1, "outputPerMillion": 2}},
        "upstream": {"apiKeyEnv": "REPLICA_KEY"},
    }
    workdir = tmp_path_factory.mktemp("keyed-gateway")
    process = GatewayProcess(config, workdir, REPLICA_KEY=API_KEY)
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


def gateway_operations(replica: RuntimeServer) -> list[schemathesis.APIOperation]:
    return [op for op in operations(replica.url) if op.path in GATEWAY_PATHS]


def bounded(body: dict[str, Any]) -> None:
    """A valid body, for the routed model, generating a few tokens at most."""
    body["model"] = MODEL  # a random model name would stop every request at a 404
    if body.get("max_tokens") is None:  # chat's default: the rest of the context
        body["max_tokens"] = MOST_TOKENS
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int):
            body[field] = min(body[field], MOST_TOKENS)
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], MOST_CHOICES)


def fuzz(
    gateway: GatewayProcess, key: str, operation: schemathesis.APIOperation, mode: GenerationMode
) -> set[int]:
    headers = {"Authorization": f"Bearer {key}"}
    return no_server_error(
        operation, mode, MAX_EXAMPLES, bounded, base_url=gateway.url, headers=headers
    )


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_through_the_gateway_produces_a_server_error(
    gateway: GatewayProcess, replicas: list[RuntimeServer], mode: GenerationMode
) -> None:
    ops = gateway_operations(replicas[0])
    assert {op.path for op in ops} == GATEWAY_PATHS  # the gateway serves each of them
    for operation in ops:
        is_post = operation.method.upper() == "POST"
        if mode is GenerationMode.NEGATIVE and not is_post:
            continue  # nothing to break in a GET without parameters
        statuses = fuzz(gateway, API_KEY, operation, mode)
        if is_post and mode is GenerationMode.POSITIVE:
            assert 200 in statuses, operation.path  # the fuzzer reached the replicas
        if mode is GenerationMode.NEGATIVE:
            assert 400 in statuses, operation.path
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_through_a_gateway_with_budgets_produces_a_server_error(
    keyed_gateway: GatewayProcess, replicas: list[RuntimeServer], mode: GenerationMode
) -> None:
    for operation in gateway_operations(replicas[0]):
        if operation.method.upper() == "POST":
            statuses = fuzz(keyed_gateway, GATEWAY_KEY, operation, mode)
            if mode is GenerationMode.POSITIVE:
                assert 200 in statuses, operation.path  # reserved, served and settled


@pytest.mark.parametrize("options", ["x", [1], 3])
def test_stream_options_that_are_not_an_object_are_a_400_under_budgets(
    keyed_gateway: GatewayProcess, options: object
) -> None:
    """A field the budget policy reads (it adds `include_usage` to a stream's options): a 500
    before; the fuzz does not combine `stream: true` with such options, a review of the policy's
    reads did."""
    response = httpx.post(
        f"{keyed_gateway.url}/v1/completions", timeout=30,
        headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
        json={"model": MODEL, "prompt": "hi", "stream": True, "stream_options": options},
    )  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_options"
