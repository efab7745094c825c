"""Finish rules and incremental text, with a character-per-token decoder."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.runtime.engine.output_processor import (
    RequestOutput,
    RequestState,
    finish_reason_for_token,
    make_output,
    stop_reason_for_token,
    update_text,
)
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.sequence import Sequence

EOS = 0


class CharDecoder:
    """Token id n is chr(n); 0 is a special token that decodes to nothing."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != EOS)

    def decode_stream(self) -> CharStream:
        return CharStream()


class CharStream:
    def step(self, token_id: int) -> str | None:
        return "" if token_id == EOS else chr(token_id)


def feed(text: str, params: SamplingParams, max_model_len: int) -> tuple[str, RequestOutput]:
    """Feed `text` token by token as the engine does; returns (streamed text, last output)."""
    state = RequestState(Sequence("r", [1, 2, 3], params))
    streamed = ""
    for char in text:
        token = EOS if char == "$" else ord(char)
        state.seq.append_token(token)
        reason = finish_reason_for_token(state.seq, token, [EOS], max_model_len)
        if reason == "stop":
            state.seq.stop_reason = stop_reason_for_token(params, token, [EOS])
        reason = update_text(state, CharDecoder(), reason)
        if reason is not None:
            state.seq.finish(reason)
        out = make_output(state, is_finished=reason is not None)
        streamed += out.new_text
        if out.finished:
            break
    return streamed, out


def stream(text: str, params: SamplingParams, max_model_len: int = 100) -> tuple[str, str, int]:
    """(streamed text, finish reason or "running", tokens generated)."""
    streamed, out = feed(text, params, max_model_len)
    return streamed, str(out.finish_reason or "running"), out.num_output_tokens


def test_stop_string_is_cut_and_never_streamed() -> None:
    assert stream("hello world, more", SamplingParams(stop=("world",), max_tokens=50)) == (
        "hello ",
        "stop",
        11,
    )


def test_eos_ends_without_text() -> None:
    assert stream("hi$there", SamplingParams(max_tokens=50)) == ("hi", "stop", 3)


def test_ignore_eos_runs_to_max_tokens() -> None:
    assert stream("hi$there", SamplingParams(max_tokens=5, ignore_eos=True)) == (
        "hith",
        "length",
        5,
    )


def test_stop_token_ids() -> None:
    params = SamplingParams(max_tokens=50, stop_token_ids=(ord("!"),))
    assert stream("wow! no", params) == ("wow", "stop", 4)


def test_max_model_len_ends_with_length() -> None:
    assert stream("abcdef", SamplingParams(max_tokens=50), max_model_len=6) == ("abc", "length", 3)


def test_prefix_of_stop_that_does_not_complete_is_released() -> None:
    assert stream("a wo wx", SamplingParams(max_tokens=7, stop=("world",))) == (
        "a wo wx",
        "length",
        7,
    )


@pytest.mark.parametrize(
    ("text", "fields", "expected"),
    [
        ("hello world, more", {"stop": ("world",)}, ("hello ", "world")),
        ("hello world, more", {"stop": ("world",), "include_stop_str_in_output": True},
         ("hello world", "world")),
        ("ab cd", {"stop": ("cd", "b c")}, ("a", "b c")),  # the earliest match is the reason
        ("wow! no", {"stop_token_ids": (ord("!"),)}, ("wow", ord("!"))),
        ("wow! no", {"stop_token_ids": (ord("!"),), "include_stop_str_in_output": True},
         ("wow!", ord("!"))),
        ("hi$there", {}, ("hi", None)),  # EOS: no stop reason
        ("hi$there", {"stop_token_ids": (EOS,)}, ("hi", None)),  # EOS first, as vLLM
        ("abcdef", {"max_tokens": 3}, ("abc", None)),  # length
        ("ab cd ab", {"stop": ("ab",), "min_tokens": 2}, ("ab cd ", "ab")),  # not before min_tokens
    ],
)  # fmt: skip
def test_stop_reason_and_include_stop_str(
    text: str, fields: dict[str, Any], expected: tuple[str, str | int | None]
) -> None:
    streamed, out = feed(text, SamplingParams(**{"max_tokens": 50, **fields}), 100)
    assert out.finished and (streamed, out.stop_reason) == expected
