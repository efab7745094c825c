"""Two gateway processes over the same runtime replicas, and replicas that really saturate.

- A gateway replica SIGKILLed mid-stream: its clients get a connection error at once (not a
  hang), the runtime aborts their requests and frees their KV, and the other gateway's streams,
  running at the same moment on the same replicas, complete with the full, correct output.
- Every replica of a model answering 429 (their own `--max-num-seqs` batch full and
  `--max-waiting 0`): the request goes to the model's fallback within its deadline, the response
  names it, and the fallback metric counts reason `saturated`.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack

import httpx
import openai
import pytest
from openai.types import Completion

from tests.support.gateway_process import GatewayProcess, start_servers
from tests.support.server_process import RuntimeServer, wait_for

pytestmark = pytest.mark.slow
MAX_NUM_SEQS = 6
# A full running batch and no queue: the next request is a 429 (the runtime's admission).
# float32: the survivors' texts are compared with each prompt run alone, and in bf16 a row's
# logits depend on the batch it shares (oneDNN takes another path for a one-row matmul; bf16
# logits round to ~0.02), which flips near-tied greedy tokens of tiny-llama within 256 tokens.
REPLICA_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-waiting",
    "0",
]
FALLBACK_AFTER_S = 30
STREAMS_PER_GATEWAY = 3
# Long enough to still be running when the other gateway dies: the survivors start last, after
# the victims, so only their own openings pass before the kill. At 256 tokens, started first, one
# CI run saw them finish while the victims' streams were still being opened; here 512 tokens ran
# 2.4-3.0 s with the kill at 0.6-1.4 s, so 1024 leaves a margin of several times.
SURVIVOR_TOKENS = 1024
VICTIM_TOKENS = 1500  # far from done when its gateway dies: its end is an abort
ABORTED = "vllm:request_success_total[('finished_reason', 'abort')]"
RUNNING = "vllm:num_requests_running"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RuntimeServer]]:
    """a and b serve `tiny`; the third serves `spare`, tiny's fallback (the last --served-name
    given wins)."""
    arg_lists = [REPLICA_ARGS, REPLICA_ARGS, [*REPLICA_ARGS, "--served-name", "spare"]]
    started = start_servers(arg_lists, tmp_path_factory.mktemp("replicas"))
    yield started
    for replica in started:
        replica.stop()


def gateway_config(replicas: list[RuntimeServer]) -> dict[str, object]:
    a, b, spare = (r.url for r in replicas)
    return {
        "models": [
            {"name": "tiny", "backends": [a, b], "fallbacks": ["spare"],
             "fallbackAfterSeconds": FALLBACK_AFTER_S},
            {"name": "spare", "backends": [spare]},
        ]
    }  # fmt: skip


@pytest.fixture(scope="module")
def gateway(
    replicas: list[RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(gateway_config(replicas), tmp_path_factory.mktemp("gateway"))
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


def async_client(url: str) -> openai.AsyncOpenAI:
    # max_retries=0: a retry would hide the connection error under test. The timeout is what a
    # hang would run into; a dead gateway must fail the stream long before it.
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def prompt(gateway_index: int, stream: int) -> str:
    return f"Story {gateway_index}.{stream}: once upon a time, in a small town by the sea,"


def total(replicas: list[RuntimeServer], key: str) -> float:
    return sum(r.metrics().get(key, 0.0) for r in replicas)


def test_a_gateway_killed_mid_stream_loses_only_its_own_streams(
    gateway: GatewayProcess, replicas: list[RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    serving = replicas[:2]
    expected = [reference_text(serving[0].url, prompt(0, i)) for i in range(STREAMS_PER_GATEWAY)]
    victim = GatewayProcess(gateway_config(replicas), tmp_path_factory.mktemp("victim"))
    aborted_before = total(serving, ABORTED)
    retries_before = gateway.metric("kvpilot_gateway_retries_total")
    try:
        survived, lost = asyncio.run(kill_mid_stream(gateway.url, victim, serving))
    finally:
        victim.stop()
    assert survived == expected
    for error in lost:
        assert isinstance(error, (httpx.TransportError, openai.APIConnectionError)), repr(error)
        assert not isinstance(error, (httpx.TimeoutException, openai.APITimeoutError)), repr(error)
    wait_for(lambda: total(serving, RUNNING) == 0, 30, "the replicas to free every request")
    assert total(serving, ABORTED) == aborted_before + STREAMS_PER_GATEWAY
    # Its clients saw nothing: no retry either (a retry would mean a replica refused one).
    assert gateway.metric("kvpilot_gateway_retries_total") == retries_before


def reference_text(url: str, text: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    completion = client.completions.create(
        model="tiny", prompt=text, max_tokens=SURVIVOR_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return completion.choices[0].text


async def kill_mid_stream(
    survivor_url: str, victim: GatewayProcess, serving: list[RuntimeServer]
) -> tuple[list[str], list[BaseException]]:
    """Streams through both gateways, all past their first token; the victim SIGKILLed; the
    survivor's texts and the errors the victim's clients got. The victims' long streams open
    first, so the survivors' shorter ones have run only since their own first token."""
    async with AsyncExitStack() as stack:
        victims = [await stack.enter_async_context(await open_stream(victim.url, 1, i,
                   VICTIM_TOKENS)) for i in range(STREAMS_PER_GATEWAY)]  # fmt: skip
        survivors = [await stack.enter_async_context(await open_stream(survivor_url, 0, i,
                     SURVIVOR_TOKENS)) for i in range(STREAMS_PER_GATEWAY)]  # fmt: skip
        firsts = [await s.__anext__() for s in (*survivors, *victims)]
        # Polled, not read once: one run in a few read 5 right after the sixth first chunk.
        await asyncio.to_thread(
            wait_for, lambda: total(serving, RUNNING) == 2 * STREAMS_PER_GATEWAY, 10,
            "every stream to run when the gateway dies",
        )  # fmt: skip
        victim.process.send_signal(signal.SIGKILL)
        texts = await asyncio.gather(*(rest_of(s, firsts[i].choices[0].text)
                                       for i, s in enumerate(survivors)))  # fmt: skip
        lost = await asyncio.gather(*(error_of(s) for s in victims))
    return list(texts), lost


async def open_stream(
    url: str, gateway_index: int, index: int, max_tokens: int
) -> openai.AsyncStream[Completion]:
    return await async_client(url).completions.create(
        model="tiny", prompt=prompt(gateway_index, index), max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip


async def rest_of(stream: openai.AsyncStream[Completion], first: str) -> str:
    return first + "".join([chunk.choices[0].text async for chunk in stream])


async def error_of(stream: openai.AsyncStream[Completion]) -> BaseException:
    started = time.monotonic()
    try:
        async for _ in stream:
            pass
    except Exception as error:  # what the client got is the result under test
        assert time.monotonic() - started < 30, "the dead gateway's client waited too long"
        return error
    raise AssertionError("a stream of the killed gateway ended as if nothing happened")


def test_every_replica_saturated_goes_to_the_fallback(
    gateway: GatewayProcess, replicas: list[RuntimeServer]
) -> None:
    a, b, spare = replicas
    labels = {"model": "tiny", "target": "spare", "reason": "saturated"}
    before = gateway.metric("kvpilot_gateway_fallbacks_total", **labels)
    picks = {r.url: gateway.metric("kvpilot_gateway_picks_total", model="tiny", backend=r.url)
             for r in (a, b)}  # fmt: skip
    headers, completion, elapsed = asyncio.run(while_saturated([a, b], gateway.url))
    assert headers["x-kvpilot-target"] == "spare"
    assert headers["x-kvpilot-backend"] == spare.url
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert elapsed < FALLBACK_AFTER_S
    assert gateway.metric("kvpilot_gateway_fallbacks_total", **labels) == before + 1
    for replica in (a, b):  # both were asked (and answered 429) before the fallback
        after = gateway.metric("kvpilot_gateway_picks_total", model="tiny", backend=replica.url)
        assert after == picks[replica.url] + 1
    wait_for(lambda: total([a, b], RUNNING) == 0, 30, "the saturating streams to be freed")


async def while_saturated(
    saturated: list[RuntimeServer], gateway_url: str
) -> tuple[Mapping[str, str], Completion, float]:
    """Fill every running slot of `saturated` with long streams, check a direct request is a 429,
    then ask the gateway for `tiny`: its response's headers and body, and how long it took."""
    async with AsyncExitStack() as stack:
        for replica in saturated:
            for index in range(MAX_NUM_SEQS):
                stream = await open_stream(replica.url, 9, index, VICTIM_TOKENS)
                await (await stack.enter_async_context(stream)).__anext__()  # it is running
        for replica in saturated:
            with pytest.raises(openai.RateLimitError):
                await async_client(replica.url).completions.create(
                    model="tiny", prompt="x", max_tokens=1
                )
        started = time.monotonic()
        raw = await async_client(gateway_url).completions.with_raw_response.create(
            model="tiny", prompt="Once upon a time", max_tokens=4
        )
        return raw.headers, raw.parse(), time.monotonic() - started
