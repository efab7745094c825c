"""`GET /v1/models` with keys: the official `openai` client's `models.list()` against the gateway
(a real aiohttp server) needs a valid key (401 otherwise) and sees only its key's models."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web

from kvpilot.gateway.budget.config import KeysDocument, key_book
from kvpilot.gateway.budget.keys import KeyRing, KeysPolicy
from kvpilot.gateway.exchange import Policy
from kvpilot.gateway.proxy import Gateway
from kvpilot.gateway.routing.routes import Backend, Route, RouteTable
from tests.support.server_process import free_port

KEYS = KeysDocument.model_validate(
    {"keys": [{"key": "sk-small-only", "models": ["small"]}, {"key": "sk-any-model"},
              {"key": "sk-nothing", "models": []}]}
)  # fmt: skip
SERVED = ["big", "small", "tiny"]


@contextlib.asynccontextmanager
async def gateway_url(policies: list[Policy]) -> AsyncIterator[str]:
    table = RouteTable()
    for name in SERVED:  # never called: listing models asks no replica
        table.put(Route(name, (Backend(f"{name}-0", "http://127.0.0.1:9"),)))
    runner = web.AppRunner(Gateway(table, policies=policies).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def listed(policies: list[Policy], api_key: str) -> list[str]:
    async with (
        gateway_url(policies) as url,
        openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0) as client,
    ):
        return sorted([model.id async for model in client.models.list()])


def keys_policy() -> KeysPolicy:
    return KeysPolicy(KeyRing(key_book(KEYS.keys, KEYS.teams)))


@pytest.mark.parametrize(
    ("key", "models"),
    [("sk-small-only", ["small"]), ("sk-any-model", SERVED), ("sk-nothing", [])],
)
def test_a_key_sees_only_its_models(key: str, models: list[str]) -> None:
    assert asyncio.run(listed([keys_policy()], key)) == models


def test_listing_models_needs_a_valid_key() -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        asyncio.run(listed([keys_policy()], "sk-unknown"))
    assert raised.value.status_code == 401
    assert raised.value.code == "invalid_api_key"


def test_listing_models_without_a_key_is_a_401() -> None:
    async def without_key() -> tuple[int, str]:
        async with (
            gateway_url([keys_policy()]) as url,
            aiohttp.ClientSession() as session,
            session.get(f"{url}/models") as response,
        ):
            return response.status, (await response.json())["error"]["message"]

    status, message = asyncio.run(without_key())
    assert status == 401 and message.startswith("no API key was given")


def test_without_keys_every_model_is_listed_to_anyone() -> None:
    assert asyncio.run(listed([], "sk-whatever")) == SERVED
