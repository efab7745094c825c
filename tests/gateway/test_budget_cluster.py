"""Budgets on Redis Cluster: a request's counters (its key's and its team's) are charged by one
Lua script, which Redis Cluster runs only when every key is in one hash slot. The counters carry
the hash tag `{<team>}` (a teamless key: `{key:<id>}`), checked here on a real redis-server in
cluster mode (one node holding every slot, which refuses a script over keys of two slots with
CROSSSLOT just as a many-node cluster does), reading the key names Redis holds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from aiohttp.test_utils import make_mocked_request
from redis.crc import key_slot

from kvpilot.gateway import bodies
from kvpilot.gateway.budget.arithmetic import Price
from kvpilot.gateway.budget.config import KEY_ID_CHARS, KeysDocument, hash_key, key_book
from kvpilot.gateway.budget.keys import KeyRing, KeysPolicy
from kvpilot.gateway.budget.policy import BudgetPolicy
from kvpilot.gateway.budget.store import RedisStore
from kvpilot.gateway.exchange import Exchange
from kvpilot.gateway.metrics import GatewayMetrics
from tests.support.redis_server import RedisServer
from tests.support.server_process import free_port, wait_for

KEYS = KeysDocument.model_validate({
    "keys": [
        {"key": "sk-research-1", "team": "research", "tpm_limit": 10_000, "rpm_limit": 100},
        {"key": "sk-research-2", "team": "research",
         "limits": [{"unit": "output_tokens", "limit": 5000, "window": "1d"}]},
        {"key": "sk-loner-key", "limits": [{"unit": "requests", "limit": 10, "window": "1h"}]},
    ],
    "teams": [{"name": "research", "limits": [{"unit": "total_tokens", "limit": 50_000,
                                               "window": "month"}]}],
})  # fmt: skip


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    workdir: Path = tmp_path_factory.mktemp("redis-cluster")
    # The cluster bus port is named: the default (port + 10000) fails for a free port > 55535.
    args = ["--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf"),
            "--cluster-port", str(free_port())]  # fmt: skip
    server = RedisServer(workdir, args=args)
    server.start()
    client = server.client()
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_for(lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), 30,
             "the one-node cluster to own every slot")  # fmt: skip
    yield server
    server.stop()


async def one_request(url: str, key: str) -> int:
    """One request of `key` reserved and settled through the real policies; its status (0:
    admitted and settled)."""
    metrics = GatewayMetrics()
    store = RedisStore(url)
    keys = KeysPolicy(KeyRing(key_book(KEYS.keys, KEYS.teams)))
    budget = BudgetPolicy(store, metrics, {"tiny": Price()}.get)
    raw = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 10}).encode()
    request = make_mocked_request(
        "POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"}
    )
    inbound = bodies.parse_body(raw, bodies.COMPLETIONS, 64)
    exchange = Exchange(request, bodies.COMPLETIONS, inbound, raw, inbound.model)
    try:
        refusal = await keys.before(exchange) or await budget.before(exchange)
        if refusal is not None:
            return refusal.status
        exchange.sent, exchange.status = True, 200
        for tap in exchange.taps:
            tap.chunk(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 10}}')
            tap.end(True)
        await budget.after(exchange)
        assert metrics.budget_store_errors.labels("settle", "admitted")._value.get() == 0
        return 0
    finally:
        await store.close()


def tag_of(name: str) -> str:
    return name[name.index("{") + 1 : name.index("}")]


def test_a_teams_counters_share_one_slot_on_redis_cluster(cluster_node: RedisServer) -> None:
    for key in ("sk-research-1", "sk-research-2", "sk-loner-key"):
        assert asyncio.run(one_request(cluster_node.url, key)) == 0, key
    keys = cluster_node.client().keys("kvpilot:budget:*")
    names = sorted(n.decode() if isinstance(n, bytes) else str(n) for n in keys)
    research = [n for n in names if tag_of(n) == "research"]
    loner = [n for n in names if n not in research]
    # research-1: tpm, rpm; research-2: output_tokens; the team's total_tokens: one counter
    # each and its in-flight part, all tagged {research}, so one slot; the teamless key's under
    # its own tag.
    assert len(research) == 2 * 4 and {tag_of(n) for n in research} == {"research"}
    assert len([n for n in research if n.endswith(":in_flight")]) == 4
    assert len({key_slot(n.encode()) for n in research}) == 1
    loner_id = hash_key("sk-loner-key")[:KEY_ID_CHARS]
    assert [tag_of(n) for n in loner] == [f"key:{loner_id}"] * 2


def test_keys_of_two_slots_are_refused_by_the_cluster_node(cluster_node: RedisServer) -> None:
    """The check above means something: this node refuses a script over two slots."""
    script = "return redis.call('GET', KEYS[1])"
    with pytest.raises(redis.ResponseError, match="hash to the same slot"):
        cluster_node.client().eval(script, 2, "kvpilot:budget:a", "kvpilot:budget:b")
