"""What the gateway reads from an OpenAI request body: the model, whether it streams, and the prompt
prefix that keys prefix affinity. Everything else passes through to the replica untouched (the
runtime honours each field or rejects it with a 400 naming it); the gateway only rejects bodies it
cannot route, before any upstream call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "completions"
CHAT = "chat/completions"


class BadRequestError(ValueError):
    """A body the gateway cannot route; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Inbound:
    model: str
    stream: bool
    prefix: str  # the first characters of the prompt, for prefix affinity
    payload: dict[str, Any]


def parse_body(raw: bytes, kind: str, prefix_chars: int) -> Inbound:
    """The routable parts of a /v1/`kind` body; BadRequestError when it is not routable."""
    try:
        payload = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequestError(f"the body is not valid JSON ({error}); send a JSON object") from None
    if not isinstance(payload, dict):
        raise BadRequestError("the body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        message = "`model` is required: the name of a served model (GET /v1/models)"
        raise BadRequestError(message, "model")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequestError("`stream` must be true or false", "stream")
    text = chat_text(payload) if kind == CHAT else prompt_text(payload)
    return Inbound(model, bool(stream), text[:prefix_chars], payload)


def prompt_text(payload: dict[str, Any]) -> str:
    """The completions prompt as text (its first prompt when a batch); token ids as their digits,
    so equal token prefixes still hash alike."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt))
    raise BadRequestError("`prompt` must be a string, a list of strings or of token ids", "prompt")


def chat_text(payload: dict[str, Any]) -> str:
    """The messages in order (system first, as sent), so tenants sharing a system prompt share
    the key's beginning."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("`messages` must be a non-empty list of messages", "messages")
    parts = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(f"messages[{index}] must be an object", f"messages[{index}]")
        parts.append(f"{message.get('role', '')}:{content_text(message.get('content'))}\n")
    return "".join(parts)


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def for_upstream(payload: dict[str, Any], raw: bytes, model: str, priority: int | None) -> bytes:
    """The body for an upstream serving `model`: `raw` when it says so already, else re-encoded
    with `model` and `priority` (vLLM's field) set, or without `priority` when the upstream does
    not take it (None: an external provider, or replicas under fcfs; the gateway's own queue
    honoured it)."""
    sent = payload.get("priority", ...)  # ...: absent (null is present, and left out too)
    same_priority = sent is ... if priority is None else type(sent) is int and sent == priority
    if payload.get("model") == model and same_priority:
        return raw
    fields = {**payload, "model": model}
    if priority is None:
        fields.pop("priority", None)
    else:
        fields["priority"] = priority
    return json.dumps(fields).encode()


def with_model(payload: dict[str, Any], model: str) -> bytes:
    """The body re-encoded for another model name (a fallback); the original bytes are sent
    unchanged otherwise."""
    return json.dumps({**payload, "model": model}).encode()
