"""kvpilot bench workloads: JSONL records and synthetic prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.runtime.bench.tokens import LocalTokenCounter, fit_prompt
from kvpilot.runtime.bench.workload import (
    BenchRequest,
    load_jsonl,
    parse_jsonl_line,
    synthetic_requests,
)

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


TINY_LLAMA = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"


@pytest.fixture(scope="module")
def tiny_counter() -> LocalTokenCounter:
    return LocalTokenCounter(TINY_LLAMA)


def synthetic(counter: LocalTokenCounter, chat: bool, **kwargs: Any) -> list[BenchRequest]:
    settings = {"input_len": 50, "output_len": 10, "range_ratio": 0.2, "seed": 3, **kwargs}
    return synthetic_requests(20, chat=chat, counter=counter, **settings)


def test_synthetic_requests_are_reproducible_and_exact_in_tokens(
    tiny_counter: LocalTokenCounter,
) -> None:
    a, b = synthetic(tiny_counter, False), synthetic(tiny_counter, False)
    assert a == b
    for r in a:
        assert isinstance(r.prompt, str)
        assert tiny_counter.count(r.prompt, add_special_tokens=True) == r.prompt_len  # BOS too
        assert 40 <= r.prompt_len <= 60 and 8 <= r.max_tokens <= 12
    assert len({r.prompt for r in a}) == 20  # no shared prompts to flatter the prefix cache
    assert len({r.prompt_len for r in a}) > 1  # the range ratio is honoured in tokens


@pytest.mark.parametrize("input_len", [1, 2, 7, 64, 300])
def test_chat_content_has_exactly_input_len_tokens(
    tiny_counter: LocalTokenCounter, input_len: int
) -> None:
    [request] = synthetic_requests(
        1, input_len=input_len, output_len=2, range_ratio=0.0, seed=input_len, chat=True,
        counter=tiny_counter,
    )  # fmt: skip
    assert isinstance(request.prompt, list) and len(request.prompt) == 1
    message = request.prompt[0]
    assert isinstance(message, dict) and message["role"] == "user"
    assert tiny_counter.count(message["content"], add_special_tokens=False) == input_len


class WordCounter:
    """Counts with a table of tokens per word, to drive fit_prompt through its branches."""

    def __init__(self, costs: dict[str, int], special: int = 0) -> None:
        self.costs, self.special = costs, special

    def count(self, text: str, add_special_tokens: bool) -> int:
        words = text.split()
        return sum(self.costs[w] for w in words) + (self.special if add_special_tokens else 0)


@pytest.mark.parametrize(
    ("words", "costs", "target", "expected"),
    [
        (["aa", "bb", "cc"], {"aa": 1, "bb": 1, "cc": 1}, 2, "aa bb"),  # one token per word
        (["aa", "bbb", "cc"], {"aa": 1, "bbb": 2, "cc": 1}, 3, "aa bbb"),  # a two-token word
        # "bbb" would overshoot 2: the shortest word that fits tops the prefix up instead
        (["aa", "bbb", "cc"], {"aa": 1, "bbb": 2, "cc": 1}, 2, "aa aa"),
        (["bbb", "bbb", "aa"], {"aa": 1, "bbb": 2}, 5, "bbb bbb aa"),
    ],
)
def test_fit_prompt_lands_on_the_target(
    words: list[str], costs: dict[str, int], target: int, expected: str
) -> None:
    assert fit_prompt(words, target, WordCounter(costs), add_special_tokens=False) == expected


def test_fit_prompt_counts_special_tokens_when_asked() -> None:
    counter = WordCounter({"aa": 1}, special=1)  # a BOS
    assert fit_prompt(["aa"] * 5, 3, counter, add_special_tokens=True) == "aa aa"


@pytest.mark.parametrize(
    ("words", "costs", "target", "message"),
    [
        (["aa"], {"aa": 1}, 4, "1 words make fewer than 4 tokens"),
        (["bbb", "bbb"], {"bbb": 2}, 3, "exactly 3 tokens from"),  # every word costs two
    ],
)
def test_fit_prompt_says_why_it_cannot(
    words: list[str], costs: dict[str, int], target: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fit_prompt(words, target, WordCounter(costs), add_special_tokens=False)


def test_fit_prompt_never_returns_an_empty_prompt() -> None:
    """With a BOS, one token is the BOS alone: no text fits, and the error says why."""
    with pytest.raises(ValueError, match=r"exactly 1 tokens with the tokenizer's special tokens"):
        fit_prompt(["aa"] * 3, 1, WordCounter({"aa": 1}, special=1), add_special_tokens=True)


def test_local_counter_names_a_directory_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json there"):
        LocalTokenCounter(tmp_path)
