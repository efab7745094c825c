"""--scheduling-policy priority on a real runtime process, through the official openai client.

Two seats (--max-num-seqs 2) are held by long low-priority requests and two more wait; a
high-priority request sent then is admitted at once, preempting a running one: its first token
comes before those of the low-priority requests that were waiting when it was sent, and the
preemption counter says why. The preempted request resumes and its greedy output is the one it
gives alone. Assertions are about order and counts, not timings: the flood requests are long
enough (hundreds of steps) that no seat frees up while the high-priority request is served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from openai import OpenAI

from kvpilot.contract.priority import label as priority_label
from tests.support.server_process import MODEL, RuntimeServer, wait_for

pytestmark = pytest.mark.slow  # starts a runtime process

NUM_SEATS = 2
NUM_FLOOD = 4  # two run, two wait
FLOOD_TOKENS = 300
LOW, HIGH = 10, -5


@dataclass
class Stream:
    """One streamed completion: when its first token arrived (client clock) and its text."""

    prompt: str
    priority: int
    max_tokens: int
    first_token_at: float | None = None
    text: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def run(client: OpenAI, stream: Stream) -> None:
    try:
        chunks = client.completions.create(
            model=MODEL, prompt=stream.prompt, max_tokens=stream.max_tokens, temperature=0,
            stream=True, extra_body={"priority": stream.priority, "ignore_eos": True},
        )  # fmt: skip
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text and stream.first_token_at is None:
                stream.first_token_at = time.monotonic()
            stream.text += chunk.choices[0].text if chunk.choices else ""
    except BaseException as exc:  # reported by the test, not lost in the thread
        stream.error = exc
    finally:
        stream.done.set()


def start(client: OpenAI, stream: Stream) -> threading.Thread:
    thread = threading.Thread(target=run, args=(client, stream), daemon=True)
    thread.start()
    return thread


def greedy_alone(client: OpenAI, prompt: str, max_tokens: int) -> str:
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return response.choices[0].text


@pytest.fixture(scope="module")
def priority_server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    # float32: greedy output must not depend on the batch a sequence ran in
    return start_server(
        "--max-model-len", "512", "--max-num-seqs", str(NUM_SEATS),
        "--scheduling-policy", "priority", "--dtype", "float32",
    )  # fmt: skip


def test_a_high_priority_request_preempts_a_low_priority_flood(
    priority_server: RuntimeServer,
) -> None:
    client = OpenAI(base_url=f"{priority_server.url}/v1", api_key="unused", max_retries=0,
                    timeout=600)  # fmt: skip
    flood = [
        Stream(f"Flood request number {i} asks for a long story:", LOW, FLOOD_TOKENS)
        for i in range(NUM_FLOOD)
    ]
    threads = [start(client, s) for s in flood]

    def is_saturated() -> bool:
        metrics = priority_server.metrics()
        running, waiting = metrics["kvpilot_requests_running"], metrics["kvpilot_requests_waiting"]
        return (running, waiting) == (NUM_SEATS, NUM_FLOOD - NUM_SEATS)

    wait_for(is_saturated, 120, "the flood to fill both seats with two waiting")
    waiting_then = [s for s in flood if s.first_token_at is None]
    assert len(waiting_then) >= NUM_FLOOD - NUM_SEATS
    urgent = Stream("An urgent question:", HIGH, 8)
    run(client, urgent)  # in this thread: it completes while the flood still runs
    assert urgent.error is None and urgent.first_token_at is not None
    waiting_still = [s for s in waiting_then if s.first_token_at is None]
    # It overtook every flood request still waiting: none got a first token before it did.
    assert waiting_still == waiting_then
    for thread in threads:
        thread.join(600)
    assert [s.error for s in flood] == [None] * NUM_FLOOD

    metrics = priority_server.metrics()
    # one victim made room; equals never preempt each other afterwards
    assert metrics["kvpilot_preemptions_by_reason_total[('reason', 'priority')]"] == 1
    assert metrics["kvpilot_preemptions_total"] == metrics["vllm:num_preemptions_total"]
    for label in (priority_label(HIGH), priority_label(LOW)):  # "-5" and ">=10"
        key = f"kvpilot_time_to_first_token_by_priority_seconds_count[('priority', '{label}')]"
        assert metrics[key] >= 1, key

    # Resuming after preemption recomputes from the prefix cache: the greedy text of every flood
    # request, the preempted one included, is the text it gives alone.
    for stream in flood:
        assert stream.text == greedy_alone(client, stream.prompt, FLOOD_TOKENS), stream.prompt
