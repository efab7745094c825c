"""No request can hurt the others (issue 40, items 12-14), on real server processes: deeply
nested JSON is a 400, one request cannot take the whole queue, a stalled or abandoned upload
ends in bounded time without a traceback."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvpilot.runtime.server.body_parsing import OFF_LOOP_MIN_BYTES
from tests.support.server_process import MODEL, RuntimeServer, wait_for

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

JSON_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
# A bound on a wait, not a timing: each of these answers in milliseconds on a healthy server.
ANSWER_S = 60.0
BODY_TIMEOUT_S = 2  # the --request-body-timeout of the `slow_uploads` server


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The", "max_tokens": 2, "temperature": 0, **fields}


# --- item 12: deeply nested JSON --------------------------------------------------------------

DEEP_BODIES = {
    "arrays, 256 KiB": b"[" * 262144,
    "objects, 256 KiB": (b'{"a":' * 50000).ljust(OFF_LOOP_MIN_BYTES, b" "),
    "arrays, small": b"[" * 5000,
    "a field 150 levels deep": b'{"model": "tiny", "zz": ' + b"[" * 150 + b"0" + b"]" * 150 + b"}",
}


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_deeply_nested_json_is_400_on_every_json_endpoint(server: RuntimeServer, path: str) -> None:
    for name, raw in DEEP_BODIES.items():
        headers = {"content-type": "application/json"}
        answer = httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=ANSWER_S)
        assert answer.status_code == 400, (name, answer.text[:300])
        error = answer.json()["error"]
        assert "nested more than 100 levels deep" in error["message"], (name, error)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("nul bytes", b"\x00" * 13),  # json.loads reads UTF-32-BE and fails mid-character
        ("latin-1", '{"prompt": "caf\xe9"}'.encode("latin-1")),
        ("large", b"\x00" * (OFF_LOOP_MIN_BYTES + 1)),  # parsed off the event loop
    ],
)
def test_a_body_that_is_not_utf8_is_400_on_every_json_endpoint(
    server: RuntimeServer, name: str, body: bytes
) -> None:
    """Found by tests/gateway/test_gateway_fuzz.py: a 500 UnicodeDecodeError before."""
    for path in JSON_ENDPOINTS:
        answer = httpx.post(f"{server.url}{path}", content=body, timeout=ANSWER_S,
                            headers={"Content-Type": "application/json"})  # fmt: skip
        assert answer.status_code == 400, (name, path, answer.text[:300])
        assert "not UTF-8 text" in answer.json()["error"]["message"], (name, path)


# --- item 13: admission counts sequences, one request cannot fill the queue --------------------


def test_one_request_of_too_many_sequences_is_refused_not_everyone_else(
    server: RuntimeServer,
) -> None:
    """The issue's request: 1024 prompts x n 16 used to queue 16k sequences (everyone else 429
    for as long as it ran); the default limit of 256 sequences per request refuses it."""
    prompts = [f"prompt {i}" for i in range(1024)]
    url = f"{server.url}/v1/completions"
    refused = httpx.post(url, json=completion(prompt=prompts, n=16), timeout=ANSWER_S)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "too_many_sequences" and error["param"] == "n"
    assert "16384 sequences (1024 prompt(s) x n 16)" in error["message"]
    assert "--max-seqs-per-request" in error["message"]
    right_after = httpx.post(url, json=completion(), timeout=ANSWER_S)
    assert right_after.status_code == 200, right_after.text
    within = httpx.post(url, json=completion(prompt=prompts[:16], n=16), timeout=ANSWER_S)
    assert within.status_code == 200, within.text  # 256: the limit itself
    assert len(within.json()["choices"]) == 256


@pytest.fixture(scope="module")
def small_queue(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    """One batch slot and three queued sequences: one request may hold all four."""
    return start_server("--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting", "3")


def held(**fields: Any) -> dict[str, Any]:
    return completion(max_tokens=400, ignore_eos=True, stream=True, **fields)


async def fill_the_queue(server: RuntimeServer) -> None:
    url = f"{server.url}/v1/completions"
    async with httpx.AsyncClient(timeout=ANSWER_S) as client:
        # 2 + 1 + 1 sequences: one runs (--max-num-seqs 1), three wait (--max-waiting 3)
        streams = [client.stream("POST", url, json=held(n=n)) for n in (2, 1, 1)]
        for stream in streams:
            assert (await stream.__aenter__()).status_code == 200
        for n in (1, 2):
            refused = await client.post(url, json=completion(n=n))
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        for stream in streams:
            await stream.__aexit__(None, None, None)

    def accepts() -> bool:
        return httpx.post(url, json=completion(n=4), timeout=ANSWER_S).status_code == 200

    await asyncio.to_thread(wait_for, accepts, ANSWER_S, "the queue free again")


def test_many_small_requests_queue_up_to_the_limit_in_sequences(
    small_queue: RuntimeServer,
) -> None:
    asyncio.run(fill_the_queue(small_queue))


def test_a_request_larger_than_the_server_holds_is_400_even_when_idle(
    small_queue: RuntimeServer,
) -> None:
    url = f"{small_queue.url}/v1/completions"
    refused = httpx.post(url, json=completion(n=5), timeout=ANSWER_S)
    assert refused.status_code == 400
    assert "more than the 4 one request may hold" in refused.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5}
    refused = httpx.post(f"{small_queue.url}/v1/chat/completions", json=chat, timeout=ANSWER_S)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    assert httpx.post(url, json=completion(n=4), timeout=ANSWER_S).status_code == 200


# --- item 14: stalled and abandoned uploads ----------------------------------------------------


@pytest.fixture(scope="module")
def slow_uploads(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    return start_server("--max-model-len", "512", "--log-level", "info",
                        "--request-body-timeout", str(BODY_TIMEOUT_S))  # fmt: skip


def headers_then(server: RuntimeServer, declared: int, sent: bytes) -> socket.socket:
    """A connection that sent a POST's headers (declaring `declared` body bytes) and `sent`."""
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=ANSWER_S)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    conn.sendall(head.encode() + sent)
    return conn


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if never)."""
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    return received


def test_a_stalled_upload_is_408_and_its_connection_closed(slow_uploads: RuntimeServer) -> None:
    with headers_then(slow_uploads, 1000, b'{"model":') as conn:
        answer = read_until_closed(conn)  # old code: nothing, until the socket timeout
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout"
    assert f"limit of {BODY_TIMEOUT_S} s (--request-body-timeout)" in error["message"]
    ok = httpx.post(f"{slow_uploads.url}/v1/completions", json=completion(), timeout=ANSWER_S)
    assert ok.status_code == 200


def test_a_client_gone_mid_upload_is_one_log_line(slow_uploads: RuntimeServer) -> None:
    before = slow_uploads.log_path.read_text()
    conn = headers_then(slow_uploads, 100_000, b'{"model": "' + b"x" * 50_000)
    conn.close()

    def logged() -> bool:
        return "client went away" in slow_uploads.log_path.read_text()[len(before) :]

    wait_for(logged, ANSWER_S, f"the disconnect logged (log: {slow_uploads.log_path})")
    assert httpx.get(f"{slow_uploads.url}/health").status_code == 200
    added = slow_uploads.log_path.read_text()[len(before) :]
    assert "Traceback" not in added, added
    assert added.count("\n") == 1, added
