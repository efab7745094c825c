"""kvpilot bench workloads: JSONL records and synthetic prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.runtime.bench.workload import load_jsonl, parse_jsonl_line, synthetic_requests

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("record", "chat", "prompt", "max_tokens"),
    [
        ({"prompt": "hello"}, False, "hello", 9),
        ({"prompt": "hello"}, True, [{"role": "user", "content": "hello"}], 9),
        ({"prompt": [1, 2, 3], "max_tokens": 4}, False, [1, 2, 3], 4),
        ({"messages": MESSAGES, "output_len": 5}, True, MESSAGES, 5),
        ({"messages": MESSAGES}, False, "hi", 9),
    ],
)
def test_records(record: dict, chat: bool, prompt: object, max_tokens: int) -> None:
    request = parse_jsonl_line(json.dumps(record), 1, chat, 9)
    assert (request.prompt, request.max_tokens) == (prompt, max_tokens)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", "line 3: not JSON"),
        ("[1, 2]", "line 3: expected an object"),
        ('{"text": "x"}', "line 3: needs a string 'prompt'"),
        ('{"prompt": [1, 2]}', None),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
        ('{"prompt": "x", "max_tokens": 1.5}', "max_tokens"),
        ('{"prompt": []}', "needs a string"),
    ],
)
def test_bad_records_name_the_line(line: str, match: str | None) -> None:
    if match is None:  # token ids are fine for completions but not for chat
        with pytest.raises(ValueError, match="needs a string"):
            parse_jsonl_line(line, 3, True, 9)
        return
    with pytest.raises(ValueError, match=match):
        parse_jsonl_line(line, 3, False, 9)


def test_load_jsonl_cycles_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert [r.prompt for r in load_jsonl(path, 5, False, 3)] == ["a", "b", "a", "b", "a"]
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_jsonl(tmp_path / "empty.jsonl", 5, False, 3)


def test_synthetic_requests_are_reproducible_and_sized() -> None:
    a = synthetic_requests(20, input_len=50, output_len=10, range_ratio=0.2, seed=3, chat=False)
    b = synthetic_requests(20, input_len=50, output_len=10, range_ratio=0.2, seed=3, chat=False)
    assert a == b
    for r in a:
        assert isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len
        assert 40 <= r.prompt_len <= 60 and 8 <= r.max_tokens <= 12
    assert len({r.prompt for r in a}) == 20  # no shared prompts to flatter the prefix cache
    chat = synthetic_requests(1, input_len=5, output_len=2, range_ratio=0.0, seed=0, chat=True)
    assert chat[0].prompt[0]["role"] == "user"  # type: ignore[index]
