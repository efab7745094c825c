"""Priorities and fair queuing at the edge (issue 36 item 2), with real `kvpilot-gateway` processes,
a real `kvpilot-runtime serve` replica of tiny-llama and the official openai client:

- two tenants (two keys of two teams, equal weights) drive one replica that the gateway counts as
  saturated at one request (`--max-in-flight-per-replica 1`), twenty requests at a time against
  two: each gets close to half the tokens served, where first come, first served would give the
  light one about a tenth;
- the request's priority reaches replicas that take the field (`schedulingPolicy: priority`), the
  key's unless the request lowers it; a raise is a 400; a provider fallback and replicas under
  fcfs (which refuse a priority they cannot honour) are sent none;
- a tenant whose queue is full gets 429 and Retry-After while another tenant still gets its turn.

Replicas that take `priority`, and a request held open, are scripted real upstreams
(tests/support/fake_upstream.py): they answer at once and record what they were sent; a fcfs runtime
(the default) refuses a priority other than 0, which is what the last test relies on.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_upstream import FakeUpstream, completion, json_answer
from tests.support.gateway_process import GatewayProcess
from tests.support.server_process import MODEL, RuntimeServer, free_port, wait_for

pytestmark = pytest.mark.slow

KEYS = {"sk-heavy-tenant": "batch", "sk-light-tenant": "chat", "sk-low-priority": "bulk"}
TEAMS = [{"name": "batch"}, {"name": "chat"}, {"name": "bulk", "priority": 5}]
# Requests each tenant keeps in flight: the light one two, so one waits while the other runs (a
# tenant with nothing waiting is not backlogged, and VTC owes it nothing), the heavy one 10x that.
HEAVY, LIGHT = 20, 2
SERVED = 30  # requests answered before the shares are read
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def scripted() -> Iterator[FakeUpstream]:
    upstream = FakeUpstream(lambda conn, _: json_answer(conn, completion("scripted", 5, 3)))
    yield upstream
    upstream.close()


def gateway_config(replica_url: str, scripted_url: str) -> dict[str, Any]:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    provider = {"baseURL": f"{scripted_url}/v1", "model": "gpt-external"}
    return {
        "models": [{"name": MODEL, "backends": [replica_url]},
                   {"name": "ranked", "backends": [scripted_url], "schedulingPolicy": "priority"},
                   {"name": "external", "backends": [dead], "fallbacks": [{"provider": provider}],
                    "schedulingPolicy": "priority"}],
        "keys": [{"key": key, "team": team} for key, team in KEYS.items()],
        "teams": TEAMS,
    }  # fmt: skip


@pytest.fixture(scope="module")
def gateway(
    replica: RuntimeServer, scripted: FakeUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(gateway_config(replica.url, scripted.url),
                             tmp_path_factory.mktemp("gateway"),
                             "--max-in-flight-per-replica", "1",
                             "--max-queued-per-tenant", str(HEAVY),
                             # a heavy request waits behind 20 (on a shared CPU: seconds each)
                             "--fallback-after", "600")  # fmt: skip
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=300)


class Load:
    """Each tenant's workers send one request after another; tokens are counted per tenant
    (prompt + output, from each answer's usage) until SERVED requests were answered."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.gateway, self.lock = gateway, threading.Lock()
        self.tokens = {"batch": 0, "chat": 0}
        self.answered, self.done = 0, threading.Event()
        self.errors: list[BaseException] = []

    def worker(self, key: str) -> None:
        openai_client, team = client(self.gateway, key), KEYS[key]
        try:
            while not self.done.is_set():
                answer = openai_client.completions.create(
                    model=MODEL, prompt=f"Tenant {team} asks: count to ten.",
                    max_tokens=OUTPUT_TOKENS, extra_body={"ignore_eos": True})  # fmt: skip
                assert answer.usage is not None
                with self.lock:
                    if not self.done.is_set():
                        self.tokens[team] += answer.usage.total_tokens
                        self.answered += 1
                        if self.answered >= SERVED:
                            self.done.set()
        except BaseException as error:  # seen by the test's thread
            self.errors.append(error)
            self.done.set()


def test_two_tenants_share_a_saturated_replica_fairly(gateway: GatewayProcess) -> None:
    load = Load(gateway)
    workers = [threading.Thread(target=load.worker, args=(key,))
               for key, count in (("sk-heavy-tenant", HEAVY), ("sk-light-tenant", LIGHT))
               for _ in range(count)]  # fmt: skip
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(600)
    assert not load.errors, load.errors
    light_share = load.tokens["chat"] / sum(load.tokens.values())
    # First come, first served gives the light tenant ~1/11 of the turns; the fair queue every
    # other one (the goal: >= 45%; a little slack for the moments between one of its
    # answers and its next request, when it has nothing waiting)
    assert light_share >= 0.42, load.tokens
    for team in ("batch", "chat"):
        served = gateway.metric("kvpilot_gateway_flow_tokens_total", model=MODEL, tenant=team)
        assert served >= load.tokens[team], team
        waited = gateway.metric("kvpilot_gateway_flow_queue_seconds_count", tenant=team)
        assert waited > 0 and gateway.metric("kvpilot_gateway_flow_ttft_seconds_count",
                                             tenant=team, priority="0") > 0  # fmt: skip
    wait_for(lambda: gateway.metric("kvpilot_gateway_flow_waiting") == 0, 60, "queue drained")


def sent_priority(upstream: FakeUpstream) -> Any:
    body = json.loads(upstream.bodies.get(timeout=60))
    return body.get("priority", "absent"), body["model"]


@pytest.mark.parametrize(
    ("key", "headers", "extra_body", "sent"),
    [
        ("sk-light-tenant", {}, {}, 0),  # the key's (its team's default)
        ("sk-low-priority", {}, {}, 5),  # its team's
        ("sk-light-tenant", {"x-kvpilot-priority": "7"}, {}, 7),  # lowered by the header
        ("sk-low-priority", {}, {"priority": 9}, 9),  # lowered in the body (vLLM's field)
    ],
)
def test_the_priority_reaches_replicas_that_take_it(
    gateway: GatewayProcess,
    scripted: FakeUpstream,
    key: str,
    headers: dict[str, str],
    extra_body: dict[str, Any],
    sent: int,
) -> None:
    openai_client = client(gateway, key)
    openai_client.completions.create(model="ranked", prompt="p", max_tokens=3,
                                     extra_headers=headers, extra_body=extra_body)  # fmt: skip
    assert sent_priority(scripted) == (sent, "ranked")


@pytest.mark.parametrize(
    ("headers", "extra_body", "says"),
    [
        ({"x-kvpilot-priority": "1"}, {}, ("priority 1 is better than key", "'s (5)")),
        ({}, {"priority": -3}, ("priority -3 is better than key", "send 5 or more")),
        ({"x-kvpilot-priority": "soon"}, {}, ("header must be an integer",)),
    ],
)
def test_a_request_cannot_raise_its_priority(
    gateway: GatewayProcess,
    scripted: FakeUpstream,
    headers: dict[str, str],
    extra_body: dict[str, Any],
    says: tuple[str, ...],
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(gateway, "sk-low-priority").completions.create(
            model="ranked", prompt="p", max_tokens=3, extra_headers=headers, extra_body=extra_body
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "priority", error
    assert all(part in error["message"] for part in says), error
    assert scripted.bodies.empty()  # refused before any upstream


def test_a_provider_fallback_is_sent_no_priority(
    gateway: GatewayProcess, scripted: FakeUpstream
) -> None:
    answer = client(gateway, "sk-light-tenant").completions.with_raw_response.create(
        model="external", prompt="p", max_tokens=3, extra_headers={"x-kvpilot-priority": "4"}
    )
    assert answer.headers["x-kvpilot-target"] == "external/0"
    assert sent_priority(scripted) == ("absent", "gpt-external")


def test_replicas_under_fcfs_are_sent_no_priority(
    gateway: GatewayProcess, replica: RuntimeServer
) -> None:
    """The runtime (under fcfs) refuses a priority it cannot honour; through the gateway the
    request is served, its priority honoured in the gateway's own queue."""
    body = {"model": MODEL, "prompt": "p", "max_tokens": 2, "priority": 4}
    direct = httpx.post(f"{replica.url}/v1/completions", json=body, timeout=60)
    assert direct.status_code == 400 and "priority" in direct.text
    answer = client(gateway, "sk-light-tenant").completions.create(
        model=MODEL, prompt="p", max_tokens=2, extra_body={"priority": 4}
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 2


class Held:
    """A scripted upstream that holds each request until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.upstream = FakeUpstream(self.answer)

    def answer(self, conn: socket.socket, _: bytes) -> None:
        self.release.wait(120)
        json_answer(conn, completion("held", 5, 3))


def test_a_full_tenant_queue_is_a_429_and_other_tenants_still_wait_their_turn(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    held = Held()
    config = {
        "models": [{"name": "held", "backends": [held.upstream.url]}],
        "keys": [{"key": key, "team": team} for key, team in KEYS.items()],
        "teams": TEAMS,
    }
    gateway = GatewayProcess(
        config,
        tmp_path_factory.mktemp("full"),
        "--max-in-flight-per-replica",
        "1",
        "--max-queued-per-tenant",
        "1",
    )
    statuses: list[int] = []

    def send(key: str) -> None:
        response = httpx.post(f"{gateway.url}/v1/completions", timeout=120,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": "held", "prompt": "p", "max_tokens": 3})  # fmt: skip
        statuses.append(response.status_code)

    senders = [threading.Thread(target=send, args=(key,))
               for key in ("sk-heavy-tenant", "sk-heavy-tenant", "sk-light-tenant")]  # fmt: skip
    try:
        senders[0].start()
        held.upstream.bodies.get(timeout=60)  # the replica's one slot is taken
        for sender in senders[1:]:
            sender.start()
        wait_for(lambda: gateway.metric("kvpilot_gateway_flow_waiting") == 2, 60, "two waiting")
        refused = httpx.post(f"{gateway.url}/v1/completions", timeout=60,
                             headers={"Authorization": "Bearer sk-heavy-tenant"},
                             json={"model": "held", "prompt": "p", "max_tokens": 3})  # fmt: skip
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "1"
        assert "--max-queued-per-tenant" in refused.json()["error"]["message"]
        assert gateway.metric("kvpilot_gateway_flow_refusals_total", tenant="batch") == 1
    finally:
        held.release.set()
        for sender in senders:
            if sender.ident is not None:  # started
                sender.join(120)
        held.upstream.close()
        code = gateway.stop()
    assert statuses == [200, 200, 200], statuses
    assert code == 0
