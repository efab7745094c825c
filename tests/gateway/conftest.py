"""Two real `kvpilot-runtime serve` replicas of tiny-llama (checking an API key, so the provider
fallback's `Authorization: Bearer` is proven) and a real `kvpilot-gateway` process in front."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gateway_process import GatewayProcess, start_replicas
from tests.support.server_process import RuntimeServer, free_port

API_KEY = "sk-gateway-test"
REPLICA_ARGS = ("--max-model-len", "2048", "--max-num-seqs", "16", "--api-key", API_KEY)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RuntimeServer]]:
    started = start_replicas(2, list(REPLICA_ARGS), tmp_path_factory.mktemp("replicas"))
    yield started
    for replica in started:
        replica.stop()  # one may have been killed by a test: its code is not checked here


@pytest.fixture(scope="module")
def gateway(
    replicas: list[RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    a, b = replicas
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    provider = {"baseURL": f"{b.url}/v1", "model": "tiny", "apiKeyEnv": "TEST_PROVIDER_KEY"}
    config = {
        "models": [
            {"name": "tiny", "backends": [a.url, b.url]},
            {"name": "broken", "backends": [dead], "fallbacks": ["tiny"]},
            {"name": "external", "backends": [dead], "fallbacks": [{"provider": provider}]},
            {"name": "nowhere", "backends": [dead]},
        ]
    }
    workdir = tmp_path_factory.mktemp("gateway")
    process = GatewayProcess(
        config, workdir, "--max-request-body-bytes", "65536", TEST_PROVIDER_KEY=API_KEY
    )
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]
