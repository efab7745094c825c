"""The keys and budget policies on one exchange each (aiohttp's own test request, the real
in-process store): 401/403, 429 with Retry-After naming the limit, reserve then settle."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvpilot.gateway import bodies
from kvpilot.gateway.budget.arithmetic import Charge, Price
from kvpilot.gateway.budget.config import KeysDocument, key_book
from kvpilot.gateway.budget.keys import KeyRing, KeysPolicy
from kvpilot.gateway.budget.policy import BudgetOptions, BudgetPolicy
from kvpilot.gateway.budget.store import Denied, MemoryStore, RedisStore
from kvpilot.gateway.exchange import Exchange, run_afters
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routing.routes import Fallback, Provider
from tests.support.server_process import free_port

KEYS = KeysDocument.model_validate({
    "keys": [
        {"key": "sk-research", "team": "research", "models": ["tiny"],
         "limits": [{"unit": "total_tokens", "limit": 300, "window": "1h"}]},
        {"key": "sk-priced", "limits": [{"unit": "cost", "limit": 1, "window": "day"}]},
    ],
    "teams": [{"name": "research", "rpm_limit": 3}],
})  # fmt: skip


def exchange(payload: dict[str, Any], key: str | None = "sk-research") -> Exchange:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = make_mocked_request("POST", "/v1/completions", headers=headers)
    raw = json.dumps(payload).encode()
    inbound = bodies.parse_body(raw, bodies.COMPLETIONS, 64)
    return Exchange(request, bodies.COMPLETIONS, inbound, raw, inbound.model)


def error_of(response: web.StreamResponse | None) -> dict[str, Any]:
    assert isinstance(response, web.Response) and response.body is not None
    body = response.body
    assert isinstance(body, bytes)
    return dict(json.loads(body)["error"])


class Harness:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.metrics = GatewayMetrics()
        self.keys = KeysPolicy(KeyRing(key_book(KEYS.keys, KEYS.teams)))
        prices = {"tiny": Price(0, 1000.0)}
        self.budget = BudgetPolicy(self.store, self.metrics, prices.get)

    async def run(
        self, ex: Exchange, answer: bytes | None, status: int = 503, sent: bool = False
    ) -> web.StreamResponse | None:
        """Both policies' `before`; then, unless one answered, `answer` as the upstream's JSON
        body through the taps (None: `status` with no upstream answer, after the request was
        `sent` upstream or not; 0: the client went away); then `after`, as the proxy does."""
        refusal = await self.keys.before(ex) or await self.budget.before(ex)
        if refusal is None and answer is not None:
            for tap in ex.taps:
                tap.chunk(answer)
                tap.end(True)
            ex.served, ex.sent, ex.status = True, True, 200
        elif refusal is None:
            ex.sent, ex.status = sent, status
        await self.budget.after(ex)
        return refusal


@pytest.mark.parametrize(
    ("key", "model", "status", "says"),
    [
        (None, "tiny", 401, "no API key was given"),
        ("sk-wrong", "tiny", 401, "the API key is not valid"),
        ("sk-research", "big", 403, "may not use model 'big'; its models: tiny"),
        ("sk-priced", "unpriced", 403, "has no price"),
    ],
)
def test_callers_are_refused_with_what_is_wrong(
    key: str | None, model: str, status: int, says: str
) -> None:
    harness = Harness()
    refusal = asyncio.run(harness.run(exchange({"model": model, "prompt": "hi"}, key), None))
    assert refusal is not None and refusal.status == status
    assert says in error_of(refusal)["message"]


def usage(prompt: int, completion: int) -> bytes:
    return json.dumps(
        {"usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    ).encode()


def test_reserve_settle_and_429_naming_the_limit_with_retry_after() -> None:
    harness = Harness()

    async def scenario() -> None:
        payload = {"model": "tiny", "prompt": "hello", "max_tokens": 100}  # reserves 13 + 100
        assert await harness.run(exchange(payload), usage(6, 20)) is None
        assert counters_of(harness) == {"total_tokens": 26, "requests": 1}  # settled to usage
        assert await harness.run(exchange(payload), None) is None  # nobody served: released
        assert counters_of(harness) == {"total_tokens": 26, "requests": 1}
        assert await harness.run(exchange({**payload, "max_tokens": 250}), usage(6, 200)) is None
        refusal = await harness.run(exchange(payload), None)  # 232 used + 113 > 300
        assert refusal is not None and refusal.status == 429
        assert int(refusal.headers["Retry-After"]) <= 3600
        assert "total_tokens 300 per 1h: 232 used" in error_of(refusal)["message"]
        tokens = harness.metrics.tokens.labels(
            KEYS.keys[0].digest()[:12], "research", "tiny", "output"
        )
        assert tokens._value.get() == 220

    asyncio.run(scenario())


def counters_of(harness: Harness) -> dict[str, float]:
    return {k.split(":")[-3]: v for k, (v, _) in harness.store.counters.items()
            if not k.endswith(":in_flight")}  # fmt: skip


@pytest.mark.parametrize(
    ("stream", "sent", "counters"),
    [
        (False, False, {"total_tokens": 0, "requests": 0}),  # left while it waited: released
        (True, False, {"total_tokens": 0, "requests": 0}),
        (True, True, {"total_tokens": 13, "requests": 1}),  # no token came: its prompt only
        (False, True, {"total_tokens": 113, "requests": 1}),  # may have generated max_tokens
    ],
)
def test_a_request_abandoned_before_its_answer(
    stream: bool, sent: bool, counters: dict[str, float]
) -> None:
    harness = Harness()
    payload = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "stream": stream}
    assert asyncio.run(harness.run(exchange(payload), None, status=0, sent=sent)) is None
    assert counters_of(harness) == counters


class GatedStore(MemoryStore):
    """The real in-process store, whose `reserve` waits for the test to open a gate: a client
    can leave while the store is answering."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    async def reserve(self, charges: Sequence[Charge]) -> Denied | None:
        self.entered.set()
        await self.gate.wait()
        return await super().reserve(charges)


def test_a_client_leaving_while_the_store_reserves_leaves_nothing_charged() -> None:
    async def scenario() -> None:
        harness = Harness()
        store = harness.store = GatedStore()
        harness.budget = BudgetPolicy(store, harness.metrics, {"tiny": Price()}.get)
        ex = exchange({"model": "tiny", "prompt": "hello", "max_tokens": 100})
        assert await harness.keys.before(ex) is None
        before = asyncio.ensure_future(harness.budget.before(ex))
        await store.entered.wait()
        before.cancel()  # the client went away (aiohttp cancels the handler)
        await asyncio.sleep(0)
        store.gate.set()  # the store charges the reservation all the same
        with pytest.raises(asyncio.CancelledError):
            await before
        assert counters_of(harness) == {"total_tokens": 113, "requests": 1}
        await run_afters([harness.budget], ex)  # as the handler's `finally` does
        assert counters_of(harness) == {"total_tokens": 0, "requests": 0}

    asyncio.run(scenario())


def test_afters_run_to_their_end_through_a_cancellation() -> None:
    class SlowAfter:
        def __init__(self) -> None:
            self.entered, self.gate, self.done = asyncio.Event(), asyncio.Event(), False

        async def before(self, exchange: Exchange) -> None:
            return None

        async def after(self, exchange: Exchange) -> None:
            self.entered.set()
            await self.gate.wait()
            self.done = True

    async def scenario() -> None:
        policy = SlowAfter()
        ex = exchange({"model": "tiny", "prompt": "hello"})
        task = asyncio.ensure_future(run_afters([policy], ex))
        await policy.entered.wait()
        task.cancel()  # a second cancellation (server shutdown) while settling
        await asyncio.sleep(0)
        assert not policy.done
        policy.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert policy.done

    asyncio.run(scenario())


def test_a_request_bigger_than_a_whole_limit_is_a_400_naming_max_tokens() -> None:
    harness = Harness()
    payload = {"model": "tiny", "prompt": "hello", "max_tokens": 1000}
    refusal = asyncio.run(harness.run(exchange(payload), None))
    assert refusal is not None and refusal.status == 400
    assert error_of(refusal)["param"] == "max_tokens"


def test_the_team_limit_counts_requests_of_every_key() -> None:
    harness = Harness()

    async def scenario() -> list[int]:
        payload = {"model": "tiny", "prompt": "x", "max_tokens": 1}
        results = [await harness.run(exchange(payload), usage(1, 1)) for _ in range(4)]
        return [r.status if r is not None else 200 for r in results]

    statuses = asyncio.run(scenario())
    assert statuses == [200, 200, 200, 429]  # the team's rpm_limit: 3


@pytest.mark.parametrize(("fail_open", "status"), [(False, 503), (True, None)])
def test_a_store_that_is_down_fails_closed_or_open(fail_open: bool, status: int | None) -> None:
    async def scenario() -> web.StreamResponse | None:
        harness = Harness()
        nowhere = RedisStore(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        options = BudgetOptions(fail_open=fail_open)
        harness.budget = BudgetPolicy(nowhere, harness.metrics, {"tiny": Price()}.get, options)
        payload = {"model": "tiny", "prompt": "hello", "max_tokens": 10}
        refusal = await harness.run(exchange(payload), usage(3, 10))
        errors = harness.metrics.budget_store_errors
        decision = "admitted" if fail_open else "refused"
        assert errors.labels("reserve", decision)._value.get() == 1
        assert errors.labels("settle", "admitted")._value.get() == (1 if fail_open else 0)
        assert harness.metrics.budget_store_up._value.get() == 0
        await nowhere.close()
        return refusal

    refusal = asyncio.run(scenario())
    if status is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.status == status
        assert error_of(refusal)["code"] == "budget_store_unavailable"


FALLBACKS: dict[str, tuple[Fallback, ...]] = {
    "tiny": ("small", "dear", "unpriced", Provider("tiny/0", "http://p/v1", "m"),
             Provider("tiny/1", "http://p/v1", "m")),
}  # fmt: skip
PRICES = {"tiny": Price(0, 1000.0), "small": Price(0, 10.0), "dear": Price(0, 5000.0),
          "tiny/1": Price(0, 5.0)}  # fmt: skip


def served_harness() -> Harness:
    harness = Harness()
    harness.budget = BudgetPolicy(harness.store, harness.metrics, PRICES.get,
                                  fallbacks_of=lambda model: FALLBACKS.get(model, ()))  # fmt: skip
    return harness


@pytest.mark.parametrize(
    ("key", "fallback", "refusal"),
    [
        ("sk-research", "small", "may not use model 'small'"),  # outside its allow-list
        ("sk-research", "tiny", None),
        ("sk-research", Provider("tiny/0", "http://p/v1", "m"), None),  # stands in for tiny
        ("sk-priced", "small", None),  # no allow-list, priced
        ("sk-priced", "unpriced", "'unpriced' has no price"),  # a cost limit cannot price it
        ("sk-priced", Provider("tiny/0", "http://p/v1", "m"), "'tiny/0' has no price"),
        ("sk-priced", Provider("tiny/1", "http://p/v1", "m"), None),  # priced by its name
    ],
)
def test_fallbacks_a_request_may_not_use(key: str, fallback: Fallback, refusal: str | None) -> None:
    """Issue 40 item 4 (and fallback pricing): the gates the keys and budget policies put on an
    exchange, which the proxy asks before each fallback."""
    harness = served_harness()
    ex = exchange({"model": "tiny", "prompt": "hello", "max_tokens": 10}, key)

    async def scenario() -> None:
        assert await harness.keys.before(ex) is None
        assert await harness.budget.before(ex) is None

    asyncio.run(scenario())
    why = ex.refusal_of(fallback)
    assert why is None if refusal is None else (why is not None and refusal in why)


def test_use_is_charged_at_the_price_of_what_served_and_reserved_at_the_dearest() -> None:
    """Issue 40 item 3: reserved at the dearest model that may serve (`dear`: 5000/M output),
    settled at the one that did (`small`: 10/M) and counted under its name."""
    harness = served_harness()
    ex = exchange({"model": "tiny", "prompt": "hello", "max_tokens": 100}, "sk-priced")

    async def scenario() -> None:
        assert await harness.keys.before(ex) is None
        assert await harness.budget.before(ex) is None
        assert counters_of(harness)["cost"] == pytest.approx(100 * 5000.0 / 1e6)
        ex.sent, ex.served, ex.status, ex.target = True, True, 200, "small"
        for tap in ex.taps:
            tap.chunk(usage(6, 20))
            tap.end(True)
        await harness.budget.after(ex)

    asyncio.run(scenario())
    assert counters_of(harness)["cost"] == pytest.approx(20 * 10.0 / 1e6)
    key_id = KEYS.keys[1].digest()[:12]
    assert harness.metrics.spend.labels(key_id, "", "small")._value.get() == pytest.approx(2e-4)
    assert harness.metrics.spend.labels(key_id, "", "tiny")._value.get() == 0


@pytest.mark.parametrize("options", ["x", [1], 3, True])
def test_stream_options_that_are_not_an_object_are_a_400_naming_them(options: object) -> None:
    """Found by tests/gateway/test_gateway_fuzz.py: a 500 (TypeError) before."""
    harness = Harness()
    payload = {"model": "tiny", "prompt": "hi", "stream": True, "stream_options": options}
    refusal = asyncio.run(harness.run(exchange(payload), None))
    assert refusal is not None and refusal.status == 400
    assert error_of(refusal)["param"] == "stream_options"
    assert counters_of(harness) == {}  # refused before anything was reserved


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_read_in_any_case(scheme: str) -> None:
    """RFC 7235: the auth scheme is case-insensitive (issue 40 item 9)."""
    ex = exchange({"model": "tiny", "prompt": "hi", "max_tokens": 1}, key=None)
    ex.request = make_mocked_request(
        "POST", "/v1/completions", headers={"Authorization": f"{scheme} sk-research"}
    )
    assert asyncio.run(KeysPolicy(KeyRing(key_book(KEYS.keys, KEYS.teams))).before(ex)) is None


@pytest.mark.parametrize(
    ("fields", "reserved_output"),
    [
        ({}, 16),  # the runtime's (and OpenAI's) default for completions
        ({"max_tokens": None}, 16),  # null is unset, as the runtime reads it
        ({"max_tokens": 40}, 40),
    ],
)
def test_a_completion_without_max_tokens_reserves_the_runtimes_default_and_is_sent_as_is(
    fields: dict[str, Any], reserved_output: int
) -> None:
    """Issue 40 item 9: `"max_tokens": null` was reserved and sent upstream as 1024."""
    harness = Harness()
    payload = {"model": "tiny", "prompt": "hello", **fields}
    ex = exchange(payload)
    body = ex.body

    async def scenario() -> None:
        assert await harness.keys.before(ex) is None
        assert await harness.budget.before(ex) is None

    asyncio.run(scenario())
    assert counters_of(harness)["total_tokens"] == len(b"hello") + 8 + reserved_output
    assert ex.body == body  # the request upstream keeps its own limit


def test_a_cache_hit_counts_as_a_request_spends_nothing_and_is_refused_over_a_limit() -> None:
    """Issue 40 item 10: a hit goes through the budget's gate: admitted when the request would
    be, then charged 1 request (the team's rpm_limit is 3) and no tokens; a 4th is refused; and
    a key whose token limit has no room for the request is refused for its cached prompt too."""
    harness = Harness()
    hit = {"model": "tiny", "prompt": "cached", "max_tokens": 4}  # reserves 6 + 8 + 4

    async def admitted(h: Harness, ex: Exchange) -> web.StreamResponse | None:
        assert await h.keys.before(ex) is None
        return await h.budget.admit_hit(ex)

    async def scenario() -> None:
        assert [await admitted(harness, exchange(hit)) for _ in range(3)] == [None] * 3
        assert counters_of(harness) == {"total_tokens": 0, "requests": 3}
        refusal = await admitted(harness, exchange(hit))
        assert refusal is not None and refusal.status == 429
        assert "requests 3 per 1m" in error_of(refusal)["message"]

    asyncio.run(scenario())
    spent = Harness()
    key_limit = next(entry for entry in spent.keys.ring.book.values() if entry.team).limits[0]
    spent.store.counters[key_limit.counter(time.time())] = (290.0, time.time() + 3600)
    refusal = asyncio.run(admitted(spent, exchange(hit)))
    assert refusal is not None and refusal.status == 429
    assert "total_tokens 300 per 1h: 290 used" in error_of(refusal)["message"]
