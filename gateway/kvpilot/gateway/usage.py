"""What a request may use (counted before it is sent) and what it used (read from its response).

The gateway has no tokenizer, so a prompt's tokens are bounded from above: the UTF-8 bytes of its
text (a byte-level BPE or SentencePiece token covers at least one byte), plus an allowance per chat
message for the template's role markers and one for special tokens. A prompt of token ids counts
exactly. The bound only sizes the reservation; the request settles to the upstream's `usage`.

`UsageTap` reads the `usage` of a JSON answer, or of a stream's last event (the budget policy asks
the upstream for it with `stream_options.include_usage` and drops that event again when the client
did not ask), and counts a stream's content chunks, which settle an aborted stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.gateway.bodies import CHAT, content_text

PER_MESSAGE_TOKENS = 16  # role markers and separators a chat template adds per message
SPECIAL_TOKENS = 8  # BOS, the generation prompt


def prompt_tokens_bound(payload: dict[str, Any], kind: str) -> int:
    """An upper bound on the prompt's tokens (every prompt of a batch counted)."""
    if kind == CHAT:
        messages = payload.get("messages") or []
        text = sum(_bytes(content_text(m.get("content"))) + _bytes(str(m.get("role", "")))
                   for m in messages if isinstance(m, dict))  # fmt: skip
        tools = _bytes(json.dumps(payload["tools"])) if payload.get("tools") else 0
        return text + tools + PER_MESSAGE_TOKENS * len(messages) + SPECIAL_TOKENS
    prompt = payload.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not _is_ids(prompt) else [prompt]
    return sum(_one_prompt(p) for p in prompts)


def _one_prompt(prompt: Any) -> int:
    if isinstance(prompt, list) and _is_ids(prompt):
        return len(prompt) + SPECIAL_TOKENS
    return _bytes(prompt if isinstance(prompt, str) else "") + SPECIAL_TOKENS


def _is_ids(values: list[Any]) -> bool:
    return all(isinstance(v, int) for v in values)


def _bytes(text: str) -> int:
    return len(text.encode())


def prompt_count(payload: dict[str, Any], kind: str) -> int:
    """How many prompts a completions batch holds (each is a request's worth of max_tokens)."""
    prompt = payload.get("prompt")
    if kind != CHAT and isinstance(prompt, list) and prompt and not _is_ids(prompt):
        return len(prompt)
    return 1


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


def usage_of(obj: Any) -> Usage | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


class UsageTap:
    """A Tap: the response's usage, its content chunks, and (when `strip`) the client never sees
    the usage-only event of a stream it did not ask usage of."""

    def __init__(self, stream: bool, strip: bool) -> None:
        self.stream, self.strip = stream, strip
        self.usage: Usage | None = None
        self.content_chunks = 0  # chunks carrying generated text (one per decoded step)
        self.ended: bool | None = None
        self.seen = False  # an upstream answer (some of it) reached the client
        self._held = b""

    def chunk(self, data: bytes) -> bytes:
        self.seen = self.seen or bool(data)
        if not self.stream:
            self._held += data  # a JSON answer: read whole at the end
            return data
        data, self._held = self._held + data, b""
        cut = data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0
        events, self._held = data[:cut], data[cut:]  # a partial event waits for its end
        return b"".join(self._event(e + b"\n\n") for e in events.split(b"\n\n") if e)

    def end(self, complete: bool) -> bytes:
        self.ended = complete
        held, self._held = self._held, b""
        if not self.stream:
            self.usage = _json_usage(held)
            return b""
        return self._event(held) if held else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        if b'"usage":null' in event or b'"usage": null' in event:
            self.content_chunks += 1  # an ordinary chunk; no need to parse it
            return event
        try:
            obj = json.loads(event[len(b"data: ") :])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return event
        usage = usage_of(obj)
        if usage is None:
            self.content_chunks += 1 if obj.get("choices") else 0
            return event
        self.usage = usage
        if obj.get("choices"):
            self.content_chunks += 1
            return event
        return b"" if self.strip else event


def _json_usage(body: bytes) -> Usage | None:
    try:
        return usage_of(json.loads(body))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
