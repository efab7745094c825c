"""From sampled tokens to what a client sees: finish rules, incremental text, stop strings.

Pure Python: the tokenizer is passed in as anything with `decode(list[int]) -> str`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvpilot.runtime.sampling import find_stop, num_emittable_chars, stop_search_start
from kvpilot.runtime.sequence import Sequence

if TYPE_CHECKING:
    from kvpilot.runtime.sequence import Timestamps


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str  # incremental detokenised text (stop strings removed)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    times: Timestamps | None = None  # on the finished output only: the engine no longer moves it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestState:
    """What has been streamed of one request so far."""

    seq: Sequence
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    pending_logprobs: list[dict[int, float]] = field(default_factory=list)


def finish_reason_for_token(
    seq: Sequence, token_id: int, eos_token_ids: list[int], max_model_len: int
) -> str | None:
    """Why the sequence ends after `token_id` was appended, or None if it goes on."""
    params = seq.params
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def update_text(state: RequestState, decoder: Decoder, reason: str | None) -> str | None:
    """Re-decode the output and apply stop strings; returns the (possibly new) finish reason.

    A token that ended the request by being a stop/EOS token is not part of the text.
    """
    seq = state.seq
    ids = seq.output_token_ids
    if reason == "stop" and ids:
        ids = ids[:-1]
    previous = len(state.text)
    state.text = decoder.decode(ids)
    stops = seq.params.stop
    if stops:
        index = find_stop(state.text, stops, stop_search_start(previous, stops))
        if index is not None:
            state.text = state.text[:index]
            return "stop"
    return reason


def make_output(state: RequestState, is_finished: bool) -> RequestOutput:
    """The increment since the last output of this request."""
    seq = state.seq
    end = num_emittable_chars(state.text, seq.params.stop, is_finished)
    end = max(end, state.num_sent_chars)
    new_text = state.text[state.num_sent_chars : end]
    new_ids = seq.output_token_ids[state.num_sent_tokens :]
    state.num_sent_chars, state.num_sent_tokens = end, seq.num_output_tokens
    logprobs = state.pending_logprobs if seq.params.logprobs is not None else None
    state.pending_logprobs = []
    return RequestOutput(
        request_id=seq.request_id,
        times=seq.times if is_finished else None,
        new_token_ids=new_ids,
        new_text=new_text,
        finished=is_finished,
        finish_reason=seq.finish_reason if is_finished else None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_output_tokens=seq.num_output_tokens,
        logprobs=logprobs,
    )
