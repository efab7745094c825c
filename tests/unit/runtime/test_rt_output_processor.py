"""Finish rules and incremental text, with a character-per-token decoder."""

from __future__ import annotations

from kvpilot.runtime.output_processor import (
    RequestState,
    finish_reason_for_token,
    make_output,
    update_text,
)
from kvpilot.runtime.sampling import SamplingParams
from kvpilot.runtime.sequence import Sequence

EOS = 0


class CharDecoder:
    """Token id n is chr(n); 0 is a special token that decodes to nothing."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != EOS)


def stream(text: str, params: SamplingParams, max_model_len: int = 100) -> tuple[str, str, int]:
    """Feed `text` token by token; returns (streamed text, finish reason, tokens generated)."""
    state = RequestState(Sequence("r", [1, 2, 3], params))
    streamed = ""
    for char in text:
        token = EOS if char == "$" else ord(char)
        state.seq.append_token(token)
        reason = finish_reason_for_token(state.seq, token, [EOS], max_model_len)
        reason = update_text(state, CharDecoder(), reason)
        if reason is not None:
            state.seq.finish(reason)
        out = make_output(state, is_finished=reason is not None)
        streamed += out.new_text
        if out.finished:
            return streamed, str(out.finish_reason), out.num_output_tokens
    return streamed, "running", state.seq.num_output_tokens


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
