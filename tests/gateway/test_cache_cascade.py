"""The response cache and cascade rules in real `kvpilot-gateway` processes, in front of two real
runtime replicas of tiny-llama (one serving it as `big`, one as `small`), driven by the official
`openai` client: hits answer without an upstream call (the replica's request counter proves it),
streamed hits replay the stored chunks, the ways to skip the cache, TTL expiry, a Redis store
shared by two gateways, and cascade rules sending short tool-less prompts to the small model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway_process import GatewayProcess, start_servers
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (the fixture)
from tests.support.server_process import RuntimeServer, wait_for

pytestmark = pytest.mark.slow
ARGS = ["--max-model-len", "2048", "--max-num-seqs", "16"]
LONG = "Once upon a time there was a little robot who lived in a quiet town by the sea. " * 2


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RuntimeServer]]:
    names = ("big", "small")
    servers = start_servers(
        [[*ARGS, "--served-name", n] for n in names], tmp_path_factory.mktemp("replicas")
    )
    try:
        yield dict(zip(names, servers, strict=True))
    finally:
        for server in servers:
            server.stop()


def config(replicas: dict[str, RuntimeServer], ttl_s: float = 600) -> dict[str, Any]:
    rule = {"when": {"maxPromptTokens": 64, "noTools": True}, "model": "small"}
    return {
        "models": [
            {"name": "big", "backends": [replicas["big"].url], "cascade": [rule]},
            {"name": "small", "backends": [replicas["small"].url]},
        ],
        "cache": {"enabled": True, "ttlSeconds": ttl_s},
    }


def start_gateway(
    replicas: dict[str, RuntimeServer], workdir: Path, *flags: str, ttl_s: float = 600
) -> GatewayProcess:
    return GatewayProcess(config(replicas, ttl_s), workdir, *flags)


@pytest.fixture(scope="module")
def gateway(
    replicas: dict[str, RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = start_gateway(replicas, tmp_path_factory.mktemp("gateway"))
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


# The openai client's header: without gateway keys a cached answer is only ever given to the
# credential it was stored for (issue 40), so raw requests that share entries send it too.
CLIENT_KEY = "unused"
CLIENT_AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=120)


def served(replica: RuntimeServer) -> float:
    """Requests the replica finished (the runtime's own counter)."""
    return sum(v for k, v in replica.metrics().items()
               if k.startswith("kvpilot_request_success_total"))  # fmt: skip


def wait_served(replica: RuntimeServer, count: float) -> None:
    wait_for(lambda: served(replica) >= count, 30, f"{replica.url} served {count} requests")


def complete(url: str, prompt: str, **extra: Any) -> Any:
    args = {"model": "small", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    return client(url).completions.with_raw_response.create(**args)


def test_a_repeated_deterministic_request_is_a_hit(
    gateway: GatewayProcess, replicas: dict[str, RuntimeServer]
) -> None:
    small = replicas["small"]
    before = served(small)
    miss = complete(gateway.url, "The cache test begins")
    assert miss.headers["x-kvpilot-cache"] == "miss"
    wait_served(small, before + 1)
    hit = complete(gateway.url, "The cache test begins")
    assert hit.headers["x-kvpilot-cache"] == "hit"
    assert hit.headers["x-kvpilot-backend"] == "cache"
    first, again = miss.parse(), hit.parse()
    assert again.choices[0].text == first.choices[0].text and again.id == first.id
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens > 0
    assert served(small) == before + 1  # no upstream call
    assert gateway.metric("kvpilot_gateway_cache_hits_total", model="small") >= 1
    assert gateway.metric("kvpilot_gateway_cache_stores_total", model="small") >= 1


def test_chat_hit(gateway: GatewayProcess, replicas: dict[str, RuntimeServer]) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    args: dict[str, Any] = {"model": "small", "messages": messages, "max_tokens": 6, "seed": 3}
    api = client(gateway.url).chat.completions.with_raw_response
    miss = api.create(**args, temperature=0.9)
    before = served(replicas["small"])
    hit = api.create(**args, temperature=0.9)
    assert (miss.headers["x-kvpilot-cache"], hit.headers["x-kvpilot-cache"]) == ("miss", "hit")
    assert hit.parse().choices[0].message.content == miss.parse().choices[0].message.content
    assert served(replicas["small"]) == before


def stream_events(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[str, list[bytes]]:
    """The cache header and the SSE events of a streamed completion."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        data = b"".join(response.iter_bytes())
    return response.headers["x-kvpilot-cache"], [e for e in data.split(b"\n\n") if e]


def test_a_streamed_hit_replays_the_stored_chunks(
    gateway: GatewayProcess, replicas: dict[str, RuntimeServer]
) -> None:
    usage = {"include_usage": True}
    body = {"model": "small", "prompt": "Streams are replayed", "max_tokens": 8,
            "temperature": 0, "stream": True, "stream_options": usage}  # fmt: skip
    state, miss = stream_events(gateway.url, body, CLIENT_AUTH)
    assert state == "miss"
    before = served(replicas["small"])
    state, hit = stream_events(gateway.url, body, CLIENT_AUTH)
    assert state == "hit" and served(replicas["small"]) == before
    assert hit[:-2] == miss[:-2]  # every chunk byte for byte...
    assert hit[-1] == miss[-1] == b"data: [DONE]"
    counts = json.loads(hit[-2].removeprefix(b"data: "))["usage"]  # ...but the usage one says
    assert counts["prompt_tokens_details"]["cached_tokens"] == counts["prompt_tokens"]
    chunks = list(client(gateway.url).completions.create(
        model="small", prompt="Streams are replayed", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "".join(
        json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in miss[:-2]
    )
    last = chunks[-1].usage
    assert last is not None and last.prompt_tokens_details is not None
    assert last.prompt_tokens_details.cached_tokens == last.prompt_tokens
    assert served(replicas["small"]) == before


def test_no_cache_and_the_cache_field_skip_the_lookup(
    gateway: GatewayProcess, replicas: dict[str, RuntimeServer]
) -> None:
    small, prompt = replicas["small"], "Skipping is allowed"
    complete(gateway.url, prompt)
    before = served(small)
    refreshed = complete(gateway.url, prompt, extra_headers={"Cache-Control": "no-cache"})
    assert refreshed.headers["x-kvpilot-cache"] == "miss"
    skipped = complete(gateway.url, prompt, extra_body={"cache": False})  # not forwarded
    assert skipped.headers["x-kvpilot-cache"] == "skip"
    wait_served(small, before + 2)
    assert complete(gateway.url, prompt).headers["x-kvpilot-cache"] == "hit"
    bad = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                     json={"model": "small", "prompt": prompt, "cache": "no"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache"


def test_a_non_deterministic_request_is_never_cached(
    gateway: GatewayProcess, replicas: dict[str, RuntimeServer]
) -> None:
    before = served(replicas["small"])
    for _ in range(2):
        answer = complete(gateway.url, "Random words", temperature=0.8)
        assert answer.headers["x-kvpilot-cache"] == "skip"
    wait_served(replicas["small"], before + 2)
    skips = gateway.metric("kvpilot_gateway_cache_skips_total", reason="not_deterministic")
    assert skips >= 2


def test_an_entry_expires_after_the_ttl(
    replicas: dict[str, RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    ttl_s = 3.0
    short = start_gateway(replicas, tmp_path_factory.mktemp("ttl"), ttl_s=ttl_s)
    try:
        stored = time.monotonic()
        assert complete(short.url, "Expiring soon").headers["x-kvpilot-cache"] == "miss"
        states: list[str] = []

        def has_expired() -> bool:
            states.append(complete(short.url, "Expiring soon").headers["x-kvpilot-cache"])
            return states[-1] == "miss"

        wait_for(has_expired, 60, "the entry to expire")
        assert states[0] == "hit" and set(states[:-1]) == {"hit"}
        assert time.monotonic() - stored >= ttl_s
        assert short.metric("kvpilot_gateway_cache_evictions_total", reason="expired") == 1
    finally:
        assert short.stop() == 0


def test_a_redis_store_is_shared_by_two_gateways(
    replicas: dict[str, RuntimeServer],
    redis_server: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    flags = ("--cache-store", "redis", "--redis-url", redis_server.url)
    first = start_gateway(replicas, tmp_path_factory.mktemp("first"), *flags)
    second = start_gateway(replicas, tmp_path_factory.mktemp("second"), *flags)
    try:
        miss = complete(first.url, "Shared across replicas")
        assert miss.headers["x-kvpilot-cache"] == "miss"
        wait_for(lambda: first.metric("kvpilot_gateway_cache_stores_total") == 1, 10, "stored")
        before = served(replicas["small"])
        hit = complete(second.url, "Shared across replicas")
        assert hit.headers["x-kvpilot-cache"] == "hit"
        assert hit.parse().choices[0].text == miss.parse().choices[0].text
        assert served(replicas["small"]) == before
        assert list(redis_server.client().scan_iter("kvpilot:{kvpilot-cache}:e:*"))
    finally:
        assert first.stop() == 0 and second.stop() == 0


def test_cascade_sends_short_tool_less_prompts_to_the_small_model(
    gateway: GatewayProcess, replicas: dict[str, RuntimeServer]
) -> None:
    big, small = served(replicas["big"]), served(replicas["small"])
    api = client(gateway.url).chat.completions.with_raw_response
    short: Any = [{"role": "user", "content": "Hi there"}]
    answer = api.create(model="big", messages=short, max_tokens=4, temperature=0.5)
    assert answer.headers["x-kvpilot-cascade"] == "0->small"
    assert answer.headers["x-kvpilot-target"] == "small"
    assert answer.parse().model == "small"
    long: Any = [{"role": "user", "content": LONG}]
    answer = api.create(model="big", messages=long, max_tokens=4, temperature=0.5)
    assert "x-kvpilot-cascade" not in answer.headers
    assert answer.headers["x-kvpilot-target"] == "big"
    tool: Any = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    answer = api.create(model="big", messages=short, max_tokens=4, temperature=0.5,
                        tools=[tool], tool_choice="none")  # fmt: skip
    assert answer.headers["x-kvpilot-target"] == "big"
    wait_served(replicas["big"], big + 2)
    wait_served(replicas["small"], small + 1)
    assert served(replicas["small"]) == small + 1
    rule = {"model": "big", "target": "small", "rule": "0"}
    assert gateway.metric("kvpilot_gateway_cascade_total", **rule) == 1


def test_a_hit_counts_as_a_request_of_the_budget(
    replicas: dict[str, RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Keys before the cache, the budget after it, and each hit through the budget's gate (issue
    40): a key allowed 5 requests sends one request 3 times (1 miss, 2 hits) and a streamed one
    twice (1 miss, 1 hit, identical events: the usage the budget forced upstream is dropped from
    both); every hit was one of its requests, so a 6th, cached, is refused."""
    keyed = {**config(replicas), "keys": [{"key": "sk-cache", "team": "t", "limits": [
        {"unit": "requests", "limit": 5, "window": "30d"}]}]}  # fmt: skip
    process = GatewayProcess(keyed, tmp_path_factory.mktemp("budget"))
    api = openai.OpenAI(base_url=f"{process.url}/v1", api_key="sk-cache", max_retries=0)
    try:
        args: dict[str, Any] = {"model": "small", "max_tokens": 4, "temperature": 0}
        states = [api.completions.with_raw_response.create(prompt="Budget counted", **args)
                  .headers["x-kvpilot-cache"] for _ in range(3)]  # fmt: skip
        assert states == ["miss", "hit", "hit"]
        body = {**args, "prompt": "Streamed budget counted", "stream": True}
        auth = {"Authorization": "Bearer sk-cache"}
        streams = [stream_events(process.url, body, auth) for _ in range(2)]
        assert [state for state, _ in streams] == ["miss", "hit"]
        assert streams[0][1] == streams[1][1]
        assert not any(b'"usage": {' in e or b'"usage":{' in e for e in streams[0][1])
        with pytest.raises(openai.RateLimitError):
            api.completions.create(prompt="Budget counted", **args)
        assert process.metric("kvpilot_gateway_cache_hits_total") == 3
    finally:
        assert process.stop() == 0
