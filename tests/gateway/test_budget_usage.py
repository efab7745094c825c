"""What a request may use (the prompt's token bound) and what it used (the UsageTap)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.gateway.bodies import CHAT, COMPLETIONS
from kvpilot.gateway.usage import (
    PER_MESSAGE_TOKENS,
    SPECIAL_TOKENS,
    Usage,
    UsageTap,
    prompt_count,
    prompt_tokens_bound,
)


@pytest.mark.parametrize(
    ("kind", "payload", "bound", "count"),
    [
        (COMPLETIONS, {"prompt": "hello"}, 5 + SPECIAL_TOKENS, 1),
        (COMPLETIONS, {"prompt": "héllo"}, 6 + SPECIAL_TOKENS, 1),  # UTF-8 bytes, not characters
        (COMPLETIONS, {"prompt": [1, 2, 3]}, 3 + SPECIAL_TOKENS, 1),  # token ids count exactly
        (COMPLETIONS, {"prompt": ["ab", "cde"]}, 5 + 2 * SPECIAL_TOKENS, 2),  # a batch
        (COMPLETIONS, {"prompt": [[1, 2], [3]]}, 3 + 2 * SPECIAL_TOKENS, 2),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]},
         4 + 2 + PER_MESSAGE_TOKENS + SPECIAL_TOKENS, 1),
        (CHAT, {"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
         6 + 8 + 4 + 2 + 2 * PER_MESSAGE_TOKENS + SPECIAL_TOKENS, 1),
    ],
)  # fmt: skip
def test_prompt_bound(kind: str, payload: dict[str, Any], bound: int, count: int) -> None:
    assert prompt_tokens_bound(payload, kind) == bound
    assert prompt_count(payload, kind) == count


def event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


CONTENT = [event({"choices": [{"index": 0, "delta": {"content": c}}], "usage": None})
           for c in ("He", "llo", "!")]  # fmt: skip
USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("split", [1, 7, 1000])  # the upstream's chunks cut events anywhere
def test_a_stream_usage_is_read_and_stripped_unless_asked(strip: bool, split: int) -> None:
    stream = b"".join(CONTENT) + USAGE + DONE
    tap = UsageTap(stream=True, strip=strip)
    out = b"".join(tap.chunk(stream[i : i + split]) for i in range(0, len(stream), split))
    out += tap.end(complete=True)
    assert out == (b"".join(CONTENT) + DONE if strip else stream)
    assert tap.usage == Usage(7, 3)
    assert tap.content_chunks == 3


def test_an_aborted_stream_counts_the_chunks_it_relayed() -> None:
    tap = UsageTap(stream=True, strip=True)
    out = tap.chunk(CONTENT[0] + CONTENT[1][:10])
    out += tap.end(complete=False)
    assert out == CONTENT[0] + CONTENT[1][:10]  # what was held back is released, not lost
    assert tap.usage is None
    assert tap.content_chunks == 1


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        (json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}}),
         Usage(4, 9)),
        (json.dumps({"error": {"message": "bad"}}), None),
        ("not json", None),
    ],
)  # fmt: skip
def test_a_json_answer_passes_whole_and_its_usage_is_read(body: str, usage: Usage | None) -> None:
    tap = UsageTap(stream=False, strip=True)
    assert tap.chunk(body.encode()) + tap.end(complete=True) == body.encode()
    assert tap.usage == usage
