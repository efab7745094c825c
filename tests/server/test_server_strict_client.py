"""What a strict OpenAI client expects of the runtime (issue 40, item 15), on a real server:
stream_options only with a stream, GET /v1/models/{id}, HEAD /health, and an error `code` that
is always a string."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

ANSWER_S = 60.0  # a bound on a wait: each of these answers in milliseconds


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The", "max_tokens": 2, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def declared_but_not_sent(server: RuntimeServer, declared: int) -> dict[str, Any]:
    """The error a POST answers from its headers alone (a Content-Length over the limit)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=ANSWER_S) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n".encode()
        )
        received = b""
        while b"\r\n\r\n" not in received:
            received += conn.recv(65536)
        head, _, body = received.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )  # fmt: skip
        while len(body) < length:
            body += conn.recv(65536)
    return dict(json.loads(body)["error"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_400(server: RuntimeServer, path: str) -> None:
    body = completion(stream_options={"include_usage": True})
    if path.endswith("chat/completions"):
        body = {**body, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{server.url}{path}", json=body, timeout=ANSWER_S)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "stream_options" and "stream: true" in error["message"]
    streamed = httpx.post(f"{server.url}{path}", json={**body, "stream": True}, timeout=ANSWER_S)
    assert streamed.status_code == 200


def test_models_retrieve_and_an_unknown_id_is_404_model_not_found(
    client: OpenAI, server: RuntimeServer
) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/other-model")
    assert info.value.code == "model_not_found"
    error = httpx.get(f"{server.url}/v1/models/nope").json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model"


def test_head_health_and_ready_are_200(server: RuntimeServer) -> None:
    for probe in ("/health", "/ready"):
        answer = httpx.head(f"{server.url}{probe}")
        assert answer.status_code == 200, probe
        assert answer.content == b""


def test_every_error_code_is_a_string(server: RuntimeServer) -> None:
    url = server.url
    answers = {
        "invalid body": httpx.post(f"{url}/v1/completions", json={"model": MODEL}),
        "malformed JSON": httpx.post(f"{url}/tokenize", content=b"{not json"),
        "too long": httpx.post(f"{url}/v1/completions", json=completion(max_tokens=10**6)),
        "unknown model": httpx.post(f"{url}/v1/completions", json=completion(model="nope")),
        "unknown route": httpx.get(f"{url}/v1/embeddings"),
        "wrong method": httpx.get(f"{url}/v1/completions"),
    }
    codes = {name: answer.json()["error"]["code"] for name, answer in answers.items()}
    codes["too large"] = declared_but_not_sent(server, 2**30)["code"]
    assert all(isinstance(code, str) and code for code in codes.values()), codes
    assert codes["unknown model"] == "model_not_found"
    assert codes["wrong method"] == "method_not_allowed"
    assert codes["too large"] == "request_too_large"
