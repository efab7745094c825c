"""Fixtures that start real `kvpilot-runtime serve` processes (stopped with SIGTERM at the end)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from openai import OpenAI

from tests.support.server_process import RuntimeServer


@pytest.fixture(scope="module")
def start_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RuntimeServer]]:
    servers: list[RuntimeServer] = []

    def start(*args: str) -> RuntimeServer:
        log = tmp_path_factory.mktemp("server") / "server.log"
        servers.append(RuntimeServer(list(args), log))
        return servers[-1]

    yield start
    codes = [server.stop() for server in servers]
    assert codes == [0] * len(servers), f"servers did not drain and exit 0: {codes}"


@pytest.fixture(scope="module")
def server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    return start_server("--max-model-len", "512", "--max-num-seqs", "8")


@pytest.fixture(scope="module", params=["auto", "hermes"])
def tool_client(
    request: pytest.FixtureRequest, start_server: Callable[..., RuntimeServer]
) -> OpenAI:
    """A client of a server per tool-call parser. tiny-llama is a Llama: `auto` reads and writes
    llama3_json calls; `hermes` is forced by the flag."""
    server = start_server("--max-model-len", "512", "--tool-call-parser", request.param)
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
