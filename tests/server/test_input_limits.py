"""The character bound, the lone-surrogate finder and the vocabulary's characters per token."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server.errors import ApiError
from kvpilot.runtime.server.input_limits import check_num_chars, declared_length
from kvpilot.runtime.server.request_checks import find_unencodable
from tests.support.server_process import TINY


@pytest.mark.parametrize(
    ("num_chars", "is_refused"), [(0, False), (512 * 4, False), (512 * 4 + 1, True)]
)
def test_character_bound(num_chars: int, is_refused: bool) -> None:
    if not is_refused:
        check_num_chars(num_chars, "prompt", 512, 4)
        return
    with pytest.raises(ApiError) as info:
        check_num_chars(num_chars, "prompt", 512, 4)
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert "at most 2048 characters fit" in info.value.message


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ('{"prompt": "fine é 😀"}', None),
        ('{"prompt": "\\ud83d\\ude00"}', None),  # a surrogate pair is one valid character
        ('{"prompt": "a\\ud800"}', "prompt"),
        ('{"prompt": [1, 2, 3]}', None),
        ('{"prompt": [[1], ["\\udc00"]]}', "prompt.1.0"),
        ('{"messages": [{"content": [{"text": "ok"}, {"text": "\\udfff"}]}]}',
         "messages.0.content.1.text"),
        ('{"logit_bias": {"\\ud800": 1}}', "logit_bias.\ud800"),
    ],
)  # fmt: skip
def test_find_unencodable_names_the_path(raw: str, path: str | None) -> None:
    data: Any = json.loads(raw)
    assert find_unencodable(data, "") == path


def test_no_vocabulary_entry_is_longer_than_max_chars_per_token() -> None:
    tok = Tokenizer(TINY)
    longest = tok.max_chars_per_token
    for token_id in range(tok.vocab_size):  # decoded text is never longer than the entry
        assert len(tok.decode([token_id], skip_special_tokens=False)) <= longest
    text = "+" + "-" * 200 + "+"
    assert len(text) / len(tok.encode(text, add_special_tokens=False)) <= longest


@pytest.mark.parametrize(
    ("headers", "length"),
    [([(b"content-length", b"12")], 12), ([], None), ([(b"content-length", b"x")], None)],
)
def test_declared_length(headers: list[tuple[bytes, bytes]], length: int | None) -> None:
    assert declared_length({"type": "http", "headers": headers}) == length
