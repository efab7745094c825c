"""The exact-match response cache's pure logic: which requests may be answered from it, the key of
one, what is stored, and what a hit sends. The stores are in cache/store.py, the policy that runs
it around a request in cache/policy.py.

- Key: the routed model (after a cascade rule), the endpoint, and the request's fields that shape
  its answer, normalised (nulls and runtime defaults dropped, float fields as floats, JSON with
  sorted keys), and the caller's scope (cache/scope.py: its team, key or credential), hashed with
  SHA-256: a hit only ever answers a caller of the scope that stored it.
- Only fields this module knows take part; a field it does not know keeps the request out of the
  cache (it may change the answer in a way the key would not see).
- Only deterministic requests: temperature 0, or a fixed `seed`.
- `stream` is part of the key: a streamed answer is stored as its SSE events and replays only to
  streamed requests, a whole answer only to whole ones (no answer is ever synthesised in the other
  shape). The client's `stream_options.include_usage` is part of it too; a usage event that was
  forced upstream for the budget is dropped on replay when the client did not ask for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KEY_VERSION = 3  # 2: entries are stored rendered (Entry.hit); 3: keyed by the caller's scope
# The request field that asks the gateway to leave the cache out (true | false); never forwarded.
CACHE_FIELD = "cache"

# Fields that shape the answer, with the runtime's default (None: no default to drop). A value
# equal to its default is left out of the key, so `"top_p": 1` and no top_p share an entry.
SHAPING_FIELDS: dict[str, Any] = {
    "prompt": None, "messages": None, "stream": False, "stream_options": None,
    "max_tokens": None, "max_completion_tokens": None, "temperature": 1.0, "top_p": 1.0,
    "top_k": -1, "n": 1, "seed": None, "stop": None, "stop_token_ids": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
    "min_tokens": 0, "logit_bias": None, "ignore_eos": False, "include_stop_str_in_output": False,
    "response_format": None, "structured_outputs": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None, "logprobs": None,
    "top_logprobs": None, "echo": False, "prompt_logprobs": None, "tools": None,
    "tool_choice": None, "parallel_tool_calls": True, "add_generation_prompt": True,
    "suffix": None,
}  # fmt: skip
FLOAT_FIELDS = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "min_p"})  # fmt: skip
# Known fields that do not change the answer (the model is keyed separately, as routed).
NEUTRAL_FIELDS = frozenset({"model", "user", CACHE_FIELD})


@dataclass(frozen=True)
class Verdict:
    """Whether a request may use the cache: its key, or why not (`skip`, a metric label)."""

    key: str | None
    skip: str = ""


@dataclass(frozen=True)
class Entry:
    """A stored answer, rendered when it is stored exactly as a hit sends it (the JSON body, or
    every SSE event with its blank line, `[DONE]` included; usage with every prompt token
    cached), so a hit costs a lookup and one write: nothing is parsed or encoded again."""

    stream: bool
    hit: bytes

    def num_bytes(self) -> int:
        return len(self.hit)

    def to_bytes(self) -> bytes:
        """The stored form (Redis): a tag saying the shape, then the bytes as sent."""
        return (STREAM_TAG if self.stream else JSON_TAG) + self.hit

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry | None:
        """None for anything another version stored (a miss, never a wrong answer)."""
        for tag, stream in ((STREAM_TAG, True), (JSON_TAG, False)):
            if data.startswith(tag):
                return cls(stream, data[len(tag) :])
        return None


STREAM_TAG, JSON_TAG = b"kvpilot-cache-2 stream\n", b"kvpilot-cache-2 json\n"


def json_entry(body: bytes) -> Entry | None:
    """What a hit sends for a whole answer, or None when it must not be stored."""
    return Entry(False, hit_body(body)) if is_whole_answer(body) else None


def stream_entry(stream: bytes, include_usage: bool) -> Entry | None:
    """What a hit sends for a stream (its usage event only when the request asked for it: that
    is part of the key), or None when it must not be stored."""
    events = events_of(stream)
    if events is None:
        return None
    return Entry(True, b"".join(hit_events(events, include_usage)))


def verdict(kind: str, model: str, payload: dict[str, Any], scope: str) -> Verdict:
    """The cache key of a request to `model` (as routed) by a caller of `scope`, or why it is
    not cached."""
    unknown = sorted(set(payload) - set(SHAPING_FIELDS) - NEUTRAL_FIELDS)
    if unknown:
        return Verdict(None, "unknown_field")
    if not is_deterministic(payload):
        return Verdict(None, "not_deterministic")
    shaping = {name: normalised(name, value) for name, value in payload.items()
               if name in SHAPING_FIELDS and not is_default(name, value)}  # fmt: skip
    document = {"v": KEY_VERSION, "scope": scope, "kind": kind, "model": model,
                "request": shaping}  # fmt: skip
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Verdict(hashlib.sha256(text.encode()).hexdigest())


def is_deterministic(payload: dict[str, Any]) -> bool:
    """Temperature 0 (greedy: every run gives one answer) or a fixed seed."""
    temperature, seed = payload.get("temperature"), payload.get("seed")
    is_greedy = _number(temperature) and temperature == 0
    return is_greedy or (isinstance(seed, int) and not isinstance(seed, bool))


def is_default(name: str, value: Any) -> bool:
    """Null (the runtime reads it as unset) or the runtime's default value."""
    default = SHAPING_FIELDS[name]
    if value is None:
        return True
    if default is None:
        return False
    if name in FLOAT_FIELDS:
        return _number(value) and float(value) == default
    return type(value) is type(default) and value == default


def normalised(name: str, value: Any) -> Any:
    if name in FLOAT_FIELDS and _number(value):
        return float(value)
    if name == "stream_options" and isinstance(value, dict) and set(value) <= {"include_usage"}:
        return {"include_usage": bool(value.get("include_usage"))}  # false and absent alike
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def wants_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


# ---- what is stored and what a hit sends ----


def events_of(stream: bytes) -> tuple[bytes, ...] | None:
    """The SSE events of a whole stream, or None when it must not be stored (no `[DONE]`, an
    error event, or something that is not `data:` events)."""
    events = tuple(e for e in stream.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip())
    if not events or events[-1] != b"data: [DONE]":
        return None
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return None
        try:
            data = json.loads(event[len(b"data: ") :])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(data, dict) or "error" in data:
            return None
    return events


def is_whole_answer(body: bytes) -> bool:
    """A complete non-streamed answer: a JSON object with choices and no error."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "error" not in data and isinstance(data.get("choices"), list)


def with_cached_usage(answer: dict[str, Any]) -> dict[str, Any]:
    """`usage.prompt_tokens_details.cached_tokens` = every prompt token (none was computed)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return answer
    prompt_tokens = usage.get("prompt_tokens") or 0
    details = {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": prompt_tokens}
    return {**answer, "usage": {**usage, "prompt_tokens_details": details}}


def hit_body(body: bytes) -> bytes:
    return json.dumps(with_cached_usage(json.loads(body))).encode()


def hit_events(events: tuple[bytes, ...], include_usage: bool) -> list[bytes]:
    """The stored events as the client gets them (each ending with its blank line): the usage
    event with every prompt token cached, or dropped when the client did not ask for usage."""
    out = []
    for event in events:
        if event == b"data: [DONE]":
            out.append(event + b"\n\n")
            continue
        data = json.loads(event[len(b"data: ") :])
        if not is_usage_event(data):
            out.append(event + b"\n\n")
        elif include_usage:
            out.append(b"data: " + json.dumps(with_cached_usage(data)).encode() + b"\n\n")
    return out


def is_usage_event(data: dict[str, Any]) -> bool:
    return data.get("usage") is not None and not data.get("choices")
