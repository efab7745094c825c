"""The response cache's pure parts: which requests it keys and how (normalisation, determinism,
unknown fields), what is stored of an answer, what a hit sends, and the in-process LRU's bounds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvpilot.gateway import bodies
from kvpilot.gateway.cache.config import CacheSpec, settings_from
from kvpilot.gateway.cache.policy import Recorder, cache_control
from kvpilot.gateway.cache.rules import (
    Entry,
    events_of,
    is_whole_answer,
    json_entry,
    stream_entry,
    verdict,
)
from kvpilot.gateway.cache.store import MemoryStore

BASE: dict[str, Any] = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0}


def key(payload: dict[str, Any], kind: str = bodies.COMPLETIONS, model: str = "tiny") -> str | None:
    return verdict(kind, model, payload, "shared").key


@pytest.mark.parametrize(
    ("case", "other"),
    [
        ("int and float temperature", {**BASE, "temperature": 0.0}),
        ("a default value", {**BASE, "top_p": 1, "n": 1, "stream": False}),
        ("null is unset", {**BASE, "seed": None, "stop": None}),
        ("user does not shape the answer", {**BASE, "user": "alice"}),
        ("the cache field is the gateway's", {**BASE, "cache": True}),
        ("the model asked for (the routed one is keyed)", {**BASE, "model": "alias"}),
        ("key order", dict(reversed(list(BASE.items())))),
    ],
)
def test_requests_with_one_answer_share_a_key(case: str, other: dict[str, Any]) -> None:
    assert key(other) == key(BASE) is not None, case


@pytest.mark.parametrize(
    ("case", "other", "kind", "model"),
    [
        ("another prompt", {**BASE, "prompt": "Once upon a tim"}, bodies.COMPLETIONS, "tiny"),
        ("another routed model", BASE, bodies.COMPLETIONS, "small"),
        ("another endpoint", BASE, bodies.CHAT, "tiny"),
        ("max_tokens", {**BASE, "max_tokens": 5}, bodies.COMPLETIONS, "tiny"),
        ("stream (the stored shape)", {**BASE, "stream": True}, bodies.COMPLETIONS, "tiny"),
        ("a stop string", {**BASE, "stop": ["\n"]}, bodies.COMPLETIONS, "tiny"),
        ("a seed with temperature 0", {**BASE, "seed": 1}, bodies.COMPLETIONS, "tiny"),
        ("a penalty", {**BASE, "presence_penalty": 0.5}, bodies.COMPLETIONS, "tiny"),
        ("usage asked for", {**BASE, "stream": True, "stream_options": {"include_usage": True}},
         bodies.COMPLETIONS, "tiny"),
    ],
)  # fmt: skip
def test_anything_that_shapes_the_answer_changes_the_key(
    case: str, other: dict[str, Any], kind: str, model: str
) -> None:
    assert key(other, kind, model) not in (None, key(BASE)), case


@pytest.mark.parametrize(
    ("payload", "skip"),
    [
        ({"model": "tiny", "prompt": "x"}, "not_deterministic"),  # the default temperature is 1
        ({**BASE, "temperature": 0.7}, "not_deterministic"),
        ({**BASE, "temperature": None}, "not_deterministic"),
        ({**BASE, "temperature": False}, "not_deterministic"),
        ({**BASE, "temperature": 0.7, "seed": True}, "not_deterministic"),
        ({**BASE, "frobnicate": 1}, "unknown_field"),  # may shape the answer: never risk a hit
        ({**BASE, "temperature": 0.7, "logit_scale": 2}, "unknown_field"),
    ],
)
def test_requests_kept_out_of_the_cache(payload: dict[str, Any], skip: str) -> None:
    assert verdict(bodies.COMPLETIONS, "tiny", payload, "shared").skip == skip
    assert verdict(bodies.COMPLETIONS, "tiny", payload, "shared").key is None


@pytest.mark.parametrize(
    "payload",
    [{**BASE, "temperature": 0.9, "seed": 7}, {**BASE, "seed": 0}, BASE],
)
def test_temperature_zero_or_a_fixed_seed_is_cached(payload: dict[str, Any]) -> None:
    assert key(payload) is not None


def test_chat_messages_are_keyed_whole() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = {"model": "tiny", "messages": messages, "temperature": 0}
    reordered = {**chat, "messages": list(reversed(messages))}
    with_tools = {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}
    keys = {key(chat, bodies.CHAT), key(reordered, bodies.CHAT), key(with_tools, bodies.CHAT)}
    assert len(keys) == 3 and None not in keys


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n")  # fmt: skip


TEXT = {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "Hi"}]}
USAGE = {"id": "c1", "object": "text_completion", "choices": [],
         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}  # fmt: skip


@pytest.mark.parametrize(
    ("stream", "stored"),
    [
        (sse(TEXT, USAGE), True),
        (sse(TEXT).replace(b"\n\n", b"\r\n\r\n"), True),
        (sse(TEXT)[: -len(b"data: [DONE]\n\n")], False),  # ended early
        (sse(TEXT, {"error": {"message": "boom"}}), False),
        (b"data: {not json\n\ndata: [DONE]\n\n", False),
        (b"event: x\n\ndata: [DONE]\n\n", False),
        (b"", False),
    ],
)
def test_only_a_whole_clean_stream_is_stored(stream: bytes, stored: bool) -> None:
    assert (events_of(stream) is not None) is stored


@pytest.mark.parametrize(
    ("body", "whole"),
    [
        (json.dumps(TEXT).encode(), True),
        (b'{"error": {"message": "bad"}}', False),
        (b'{"object": "list"}', False),
        (b"<html>", False),
    ],
)
def test_only_an_answer_with_choices_is_stored(body: bytes, whole: bool) -> None:
    assert is_whole_answer(body) is whole


def test_a_hit_says_every_prompt_token_was_cached() -> None:
    answer = {**TEXT, "usage": USAGE["usage"]}
    stored = json_entry(json.dumps(answer).encode())
    assert stored is not None and not stored.stream
    sent = json.loads(stored.hit)  # rendered when stored: the hit sends these bytes
    assert sent["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert sent["choices"] == TEXT["choices"]


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_streamed_hit_replays_the_events(include_usage: bool) -> None:
    stored = stream_entry(sse(TEXT, TEXT, USAGE), include_usage)
    assert stored is not None and stored.stream
    sent = [e + b"\n\n" for e in stored.hit.split(b"\n\n") if e]
    assert sent[:2] == [b"data: " + json.dumps(TEXT).encode() + b"\n\n"] * 2  # byte for byte
    assert sent[-1] == b"data: [DONE]\n\n"
    if include_usage:
        usage = json.loads(sent[2].removeprefix(b"data: "))["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert len(sent) == (4 if include_usage else 3)  # a usage event forced upstream is dropped
    assert b"".join(sent) == stored.hit


def test_entries_survive_their_stored_form() -> None:
    for entry in (Entry(False, b'{"a": "\\u00e9"}'), Entry(True, b"data: x\n\n")):
        assert Entry.from_bytes(entry.to_bytes()) == entry
    old_form = b'{"stream": false, "body": "{}"}'  # what the first version stored
    assert Entry.from_bytes(old_form) is None  # a miss, never a wrong answer


def test_the_recorder_keeps_what_the_client_got_up_to_its_bound() -> None:
    recorder = Recorder(max_bytes=1000)
    stream = sse(TEXT)
    assert recorder.chunk(stream[:10]) + recorder.chunk(stream[10:]) == stream
    assert recorder.entry(stream=True) is None  # not ended yet
    recorder.end(complete=True)
    assert recorder.entry(stream=True) == Entry(True, stream)
    small = Recorder(max_bytes=10)
    small.chunk(stream)
    small.end(complete=True)
    assert small.entry(stream=True) is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(size: int) -> Entry:
    return Entry(False, b"x" * size)


def test_memory_store_expires_after_the_ttl() -> None:
    clock, evicted = Clock(), list[str]()
    store = MemoryStore(10, 100, 10_000, evicted.append, clock)

    async def scenario() -> None:
        await store.put("a", entry(5))
        clock.now = 9.9
        assert await store.get("a") == entry(5)
        clock.now = 10.0
        assert await store.get("a") is None

    asyncio.run(scenario())
    assert evicted == ["expired"] and store.num_bytes == 0


@pytest.mark.parametrize(
    ("max_entries", "max_bytes", "left"),
    [(2, 10_000, ["b", "a"]), (10, 250, ["b", "a"]), (10, 10_000, ["c", "b", "a"])],
)
def test_memory_store_drops_the_least_recently_used(
    max_entries: int, max_bytes: int, left: list[str]
) -> None:
    evicted: list[str] = []
    store = MemoryStore(60, max_entries, max_bytes, evicted.append, Clock())

    async def scenario() -> list[str]:
        await store.put("c", entry(100))
        await store.put("b", entry(100))
        await store.get("c")  # c used most recently...
        await store.get("b")  # ...then b: c is the least recently used
        await store.put("a", entry(100))
        return [k for k in ("c", "b", "a") if await store.get(k) is not None]

    assert sorted(asyncio.run(scenario())) == sorted(left)
    assert evicted == ["size"] * (3 - len(left))
    assert store.num_bytes == 100 * len(left)


def test_memory_store_refuses_an_entry_over_its_bytes() -> None:
    store = MemoryStore(60, 10, 50, clock=Clock())
    assert asyncio.run(store.put("a", entry(51))) is False
    assert len(store) == 0


@pytest.mark.parametrize(
    ("header", "directives"),
    [("", set()), ("No-Cache", {"no-cache"}), ("max-age=0, no-store", {"max-age", "no-store"})],
)
def test_cache_control_directives(header: str, directives: set[str]) -> None:
    assert cache_control(header) == directives


def test_settings_from_the_file_and_flags() -> None:
    spec = CacheSpec.model_validate({"enabled": True, "ttlSeconds": 5})
    assert settings_from(spec, None, None).ttl_s == 5
    assert settings_from(CacheSpec(), "memory", None).enabled  # the flag turns it on
    assert not settings_from(CacheSpec(), None, None).enabled
    with pytest.raises(ValueError, match="--redis-url"):
        settings_from(spec, "redis", None)


def test_the_scope_is_team_key_or_shared() -> None:
    assert settings_from(CacheSpec(), "memory", None).scope == "team"  # the default
    spec = CacheSpec.model_validate({"enabled": True, "scope": "key"})
    assert settings_from(spec, None, None).scope == "key"
    assert settings_from(spec, None, None, "shared").scope == "shared"  # --cache-scope wins
    with pytest.raises(ValueError, match=r"'tenant' is not one of team .*, key .* or shared"):
        CacheSpec.model_validate({"scope": "tenant"})


def test_the_scope_is_part_of_the_key() -> None:
    keys = {verdict(bodies.COMPLETIONS, "tiny", BASE, scope).key
            for scope in ("shared", "team:a", "team:b", "key:k1", "anonymous")}  # fmt: skip
    assert len(keys) == 5
