"""Budgets with real processes: two `kvpilot-gateway` replicas sharing one real redis-server, in
front of two `kvpilot-runtime serve` replicas of tiny-llama, called with the official `openai`
client. One budget across replicas never overspends; a Redis restart serves nothing outside the
policy and recovers within 5 s; streams settle from the usage the client did not ask for, and an
abandoned stream settles what it relayed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest

from kvpilot.gateway.budget.arithmetic import Limit, parse_window
from kvpilot.gateway.budget.config import KEY_ID_CHARS, hash_key
from tests.support.gateway_process import GatewayProcess, start_replicas
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.support.server_process import MODEL, RuntimeServer, wait_for

pytestmark = pytest.mark.slow

TEAM = "tests"
WINDOW = "30d"  # long and fixed: a test never straddles two windows in practice
SHARED_BUDGET = 10_000
MAX_TOKENS = 64
KEYS = {
    "sk-shared-budget": [{"unit": "total_tokens", "limit": SHARED_BUDGET, "window": WINDOW}],
    "sk-restart": [{"unit": "total_tokens", "limit": 3000, "window": WINDOW}],
    "sk-stream": [{"unit": "input_tokens", "limit": 100_000, "window": WINDOW},
                  {"unit": "output_tokens", "limit": 100_000, "window": WINDOW}],
    "sk-abort": [{"unit": "output_tokens", "limit": 100_000, "window": WINDOW}],
}  # fmt: skip
# Tokens a replica may generate between the gateway's last relayed chunk and its abort (chunks
# on the wire when the client left, the step running then): generated but never relayed, so
# never charged.
IN_FLIGHT_TOKENS = 4
PROMPT = "The budget of a key is shared by every gateway replica because"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RuntimeServer]]:
    args = ["--max-model-len", "2048", "--max-num-seqs", "32"]
    started = start_replicas(2, args, tmp_path_factory.mktemp("replicas"))
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def gateways(
    replicas: list[RuntimeServer],
    redis_server: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[GatewayProcess]]:
    config = {
        "models": [{"name": MODEL, "backends": [r.url for r in replicas]}],
        "keys": [{"key": key, "team": TEAM, "limits": limits} for key, limits in KEYS.items()],
    }
    started: list[GatewayProcess] = []
    for index in range(2):
        workdir = tmp_path_factory.mktemp(f"gateway{index}")
        started.append(GatewayProcess(config, workdir, "--redis-url", redis_server.url))
    yield started
    for gateway in started:
        assert gateway.stop() == 0, gateway.log_path.read_text()[-3000:]


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test as it was answered.
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def counter(redis: RedisServer, key: str, unit: str) -> float:
    limit = Limit(f"key:{hash_key(key)[:KEY_ID_CHARS]}", unit, 1, parse_window(WINDOW), TEAM)
    return float(redis.client().get(limit.counter(time.time())) or 0)


def test_one_budget_across_two_gateways_never_overspends(
    gateways: list[GatewayProcess],
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """32 concurrent clients on one key with a 10,000-token budget, half on each gateway, each
    asking until it gets a 429: what they were served adds up to the budget, never more."""
    key = "sk-shared-budget"
    used: list[int] = []
    refusals: list[openai.RateLimitError] = []

    def until_refused(index: int) -> None:
        openai_client = client(gateways[index % 2], key)
        while True:
            try:
                answer = openai_client.completions.create(
                    model=MODEL, prompt=f"{PROMPT} ({index})", max_tokens=MAX_TOKENS,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
            except openai.RateLimitError as error:
                refusals.append(error)
                return
            assert answer.usage is not None
            used.append(answer.usage.total_tokens)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(until_refused, range(32)))
    assert sum(used) <= SHARED_BUDGET + MAX_TOKENS, f"overspent: {sum(used)} tokens served"
    assert sum(used) >= SHARED_BUDGET * 0.8, f"the budget was not used up: {sum(used)}"
    assert counter(redis_server, key, "total_tokens") == sum(used)  # settled to the usage
    message = str(refusals[0])
    assert f"total_tokens {SHARED_BUDGET} per {WINDOW}" in message
    retry_after = int(refusals[0].response.headers["Retry-After"])
    assert 0 < retry_after <= parse_window(WINDOW).seconds
    for gateway in gateways:  # both replicas admitted requests from the one budget
        assert gateway.metric("kvpilot_gateway_requests_total", code="200") > 0


@dataclass
class Call:
    sent: float
    answered: float
    status: int
    tokens: int


def test_redis_restarted_mid_load_refuses_and_recovers_within_5s(
    gateways: list[GatewayProcess],
    redis_server: RedisServer,  # noqa: F811
) -> None:
    key = "sk-restart"
    calls: list[Call] = []
    stop = threading.Event()

    def load(index: int) -> None:
        openai_client = client(gateways[index % 2], key)
        while not stop.is_set():
            sent = time.monotonic()
            try:
                answer = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16)
                tokens = answer.usage.total_tokens if answer.usage else 0
                calls.append(Call(sent, time.monotonic(), 200, tokens))
            except openai.APIStatusError as error:
                calls.append(Call(sent, time.monotonic(), error.status_code, 0))
                time.sleep(0.05)  # a refused client retries soon, not in a tight loop

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, index) for index in range(8)]
        time.sleep(3)
        redis_server.stop()
        down = time.monotonic()
        time.sleep(3)
        restarting = time.monotonic()
        redis_server.start()
        up = time.monotonic()
        time.sleep(7)
        stop.set()
        for future in futures:
            future.result()

    during = [c for c in calls if c.sent > down and c.answered < restarting]
    assert during, "no request was sent while Redis was down"
    assert {c.status for c in during} == {503}, "a request was served without a reservation"
    after = sorted((c for c in calls if c.sent > up and c.status != 503), key=lambda c: c.answered)
    assert after, "nothing was admitted after Redis returned"
    assert after[0].answered - up <= 5.0
    served = sum(c.tokens for c in calls if c.status == 200)
    assert served <= 3000
    # Requests in flight when Redis went down keep their reservation: counted high, never low.
    assert served <= counter(redis_server, key, "total_tokens") <= 3000
    assert sum(g.metric("kvpilot_gateway_budget_store_errors_total") for g in gateways) > 0
    assert all(g.metric("kvpilot_gateway_budget_store_up") == 1 for g in gateways)
    assert any("budget store down" in line for g in gateways for line in g.log_lines())


def test_a_stream_settles_from_usage_the_client_did_not_ask_for(
    gateways: list[GatewayProcess],
    redis_server: RedisServer,  # noqa: F811
) -> None:
    key = "sk-stream"
    openai_client = client(gateways[0], key)
    exact = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    assert exact.usage is not None
    prompt_tokens = exact.usage.prompt_tokens
    # The key is this test's alone, in this module's fresh Redis: settled, it holds one prompt.
    wait_for(lambda: counter(redis_server, key, "input_tokens") == prompt_tokens, 10,
             "the first request's reservation to settle")  # fmt: skip
    before = counter(redis_server, key, "input_tokens")
    chunks = list(openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                    stream=True))  # fmt: skip
    assert chunks and all(c.usage is None and c.choices for c in chunks)  # stripped again
    # The reservation counted the prompt's UTF-8 bytes; it settles to the real prompt tokens once
    # the stream has ended, which the client may see first (the gateway settles after [DONE]).
    wait_for(lambda: counter(redis_server, key, "input_tokens") - before <= prompt_tokens, 10,
             "the stream's reservation to settle")  # fmt: skip
    assert counter(redis_server, key, "input_tokens") - before == prompt_tokens
    asked = list(openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert asked[-1].usage is not None and asked[-1].choices == []


def generated(replicas: list[RuntimeServer]) -> float:
    """Tokens the replicas generated (a request counts when it finishes or is aborted)."""
    return sum(r.metrics()["kvpilot_generation_tokens_total"] for r in replicas)


def running(replicas: list[RuntimeServer]) -> float:
    return sum(r.metrics()["vllm:num_requests_running"] for r in replicas)


def test_an_abandoned_stream_settles_what_it_relayed(
    gateways: list[GatewayProcess],
    replicas: list[RuntimeServer],
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """A client drops its stream after 3 events: the reservation (1500 output tokens) comes back
    and the key is charged what the replica generated for it, up to the tokens still in flight
    when the gateway closed the upstream connection."""
    key, reserved = "sk-abort", 1500
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": reserved, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{gateways[1].url}/v1/completions"
    wait_for(lambda: running(replicas) == 0, 30, "the replicas to be idle")
    before, charged_before = generated(replicas), counter(redis_server, key, "output_tokens")
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # read as far as 3 events; closed when `with` ends
        events = 0
        while events < 3:
            events += next(lines).startswith("data: {")
        reserved_now = counter(redis_server, key, "output_tokens") - charged_before
        assert reserved_now == reserved  # reserved while it runs
    # The client went away: the gateway settles the chunks it relayed, not the reservation.
    wait_for(lambda: counter(redis_server, key, "output_tokens") - charged_before < reserved, 30,
             "the settle")  # fmt: skip
    wait_for(lambda: running(replicas) == 0, 30, "the replica to abort the request")
    settled = counter(redis_server, key, "output_tokens") - charged_before
    made = generated(replicas) - before
    print(f"abandoned stream: relayed >= {events}, settled {settled}, generated {made}")
    assert 3 <= settled <= made < reserved
    assert made - settled <= IN_FLIGHT_TOKENS, f"settled {settled} of {made} generated"
    metric = gateways[1].metric("kvpilot_gateway_tokens_total", kind="output",
                                key_id=hash_key(key)[:KEY_ID_CHARS])  # fmt: skip
    assert metric == settled + charged_before


def test_keys_are_required_and_checked(gateways: list[GatewayProcess]) -> None:
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        client(gateways[0], "sk-nobody").completions.create(model=MODEL, prompt="x", max_tokens=1)
    answer = httpx.post(f"{gateways[0].url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in client(gateways[0], "sk-stream").models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        client(gateways[0], "sk-nobody").models.list()
