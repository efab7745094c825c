"""An upstream that dies in the middle of an SSE event (issue 40 item 5), through a real gateway
process to the official `openai` client: the client gets the complete events, then the gateway's
error event, and raises `openai.APIError`, never a JSONDecodeError on half an event. The upstream
is a scripted real server (tests/support/fake_upstream.py): a replica does not die mid-event on
demand."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.fake_upstream import FakeUpstream, cut_mid_event
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow  # starts a gateway process

CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "cut",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello"},
                      "finish_reason": None}]}  # fmt: skip
WHOLE = f"data: {json.dumps(CHUNK)}\n\n".encode()
HALF = b'data: {"id":"x","choi'  # the reproducer: the upstream died here


def cut_after(events: bytes) -> FakeUpstream:
    def answer(conn: socket.socket, _: bytes) -> None:
        cut_mid_event(conn, events)

    return FakeUpstream(answer)


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, FakeUpstream]]:
    started = {"half": cut_after(HALF), "whole-then-half": cut_after(WHOLE + HALF)}
    yield started
    for upstream in started.values():
        upstream.close()


@pytest.fixture(scope="module")
def gateway(upstreams: dict[str, FakeUpstream], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:  # fmt: skip
    config = {"models": [{"name": name, "backends": [upstream.url]}
                         for name, upstream in upstreams.items()]}  # fmt: skip
    process = GatewayProcess(config, Path(tmp_path_factory.mktemp("gateway")))
    yield process
    assert process.stop() == 0, process.log_path.read_text()[-3000:]


@pytest.mark.parametrize(("model", "contents"), [("half", []), ("whole-then-half", ["Hello"])])
def test_an_upstream_dead_mid_event_ends_the_stream_with_an_api_error(
    gateway: GatewayProcess, model: str, contents: list[str]
) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    seen: list[str] = []
    with pytest.raises(openai.APIError, match="failed mid-stream") as raised:
        for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert not isinstance(raised.value, json.JSONDecodeError)
    assert seen == contents  # every whole event, and nothing of the broken one
    assert any("broke off mid-event" in line for line in gateway.log_lines())
