"""What the gateway reads from a request body, and the bodies it refuses before any upstream
call."""

from __future__ import annotations

import json

import pytest

from kvpilot.gateway.bodies import CHAT, COMPLETIONS, BadRequestError, parse_body, with_model

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hi"}
PARTS = [{"type": "text", "text": "xyz"}]


@pytest.mark.parametrize(
    ("kind", "body", "stream", "prefix"),
    [
        (COMPLETIONS, {"model": "m", "prompt": "hello world"}, False, "hello"),
        (COMPLETIONS, {"model": "m", "prompt": ["first", "second"]}, False, "first"),
        (COMPLETIONS, {"model": "m", "prompt": [1, 22, 333]}, False, "1,22,"),
        (COMPLETIONS, {"model": "m", "prompt": [[5, 6]], "stream": True}, True, "5,6"),
        (CHAT, {"model": "m", "messages": [SYSTEM, USER]}, False, "syste"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": PARTS}]}, False, "user:"),
    ],
)
def test_routable_bodies(kind: str, body: dict[str, object], stream: bool, prefix: str) -> None:
    inbound = parse_body(json.dumps(body).encode(), kind, prefix_chars=5)
    assert (inbound.model, inbound.stream, inbound.prefix) == ("m", stream, prefix)


def test_chat_key_starts_with_the_system_prompt_so_tenants_share_it() -> None:
    system = {"role": "system", "content": "You are the support bot of tenant 7. " * 10}
    keys = {
        parse_body(chat_body([system, {"role": "user", "content": q}]), CHAT, 200).prefix
        for q in ("where is my order?", "refund please")
    }
    assert len(keys) == 1


def chat_body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


@pytest.mark.parametrize(
    ("kind", "raw", "param", "message"),
    [
        (COMPLETIONS, b"{not json", None, "not valid JSON"),
        (COMPLETIONS, b"\xff\xfe", None, "not valid JSON"),
        (COMPLETIONS, b"[1, 2]", None, "must be a JSON object"),
        (COMPLETIONS, b'{"prompt": "x"}', "model", "`model` is required"),
        (COMPLETIONS, b'{"model": 3, "prompt": "x"}', "model", "`model` is required"),
        (COMPLETIONS, b'{"model": "m", "prompt": "x", "stream": "yes"}', "stream", "true or false"),
        (COMPLETIONS, b'{"model": "m"}', "prompt", "`prompt` must be"),
        (COMPLETIONS, b'{"model": "m", "prompt": {"a": 1}}', "prompt", "`prompt` must be"),
        (CHAT, b'{"model": "m"}', "messages", "non-empty list"),
        (CHAT, b'{"model": "m", "messages": []}', "messages", "non-empty list"),
        (CHAT, b'{"model": "m", "messages": ["hi"]}', "messages[0]", "must be an object"),
    ],
)
def test_unroutable_bodies(kind: str, raw: bytes, param: str | None, message: str) -> None:
    with pytest.raises(BadRequestError, match=message) as error:
        parse_body(raw, kind, prefix_chars=8)
    assert error.value.param == param


def test_with_model_substitutes_only_the_model() -> None:
    body = json.loads(with_model({"model": "a", "prompt": "p", "max_tokens": 3}, "b"))
    assert body == {"model": "b", "prompt": "p", "max_tokens": 3}
