"""From sampled tokens to what a client sees: finish rules, incremental text, stop strings.

Pure Python: the tokenizer is passed in as anything with `decode(list[int]) -> str` and
`decode_stream()` (a detokeniser fed one token at a time, tokenizers' DecodeStream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvpilot.runtime.engine.sampling import (
    PromptLogprob,
    SamplingParams,
    find_stop_match,
    num_emittable_chars,
    stop_search_start,
)
from kvpilot.runtime.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvpilot.runtime.engine.sequence import Timestamps


class TextStream(Protocol):
    def step(self, token_id: int) -> str | None:
        """The text this token completes (None while a character is still incomplete)."""


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...

    def decode_stream(self) -> TextStream: ...


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
    stop_reason: str | int | None = None  # once finished: the stop string or stop token id
    # With prompt_logprobs, in the first output: positions 1 .. num_prompt_tokens - 1 (position
    # 0 has nothing before it to be scored by).
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class RequestState:
    """What has been streamed of one request so far."""

    seq: Sequence
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    pending_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    is_prompt_logprobs_sent: bool = False
    text_stream: TextStream | None = None  # the output detokenised so far, token by token

    def add_prompt_logprobs(self, scored: list[PromptLogprob]) -> None:
        self.prompt_logprobs += scored
        self.seq.num_scored_prompt_tokens += len(scored)


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


def stop_reason_for_token(
    params: SamplingParams, token_id: int, eos_token_ids: list[int]
) -> int | None:
    """The stop token id that ended a sequence, as vLLM reports it: None for EOS."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return None
    return token_id if token_id in params.stop_token_ids else None


def update_text(state: RequestState, decoder: Decoder, reason: str | None) -> str | None:
    """Extend the text by the output's last token and apply stop strings; returns the
    (possibly new) finish reason and records a matched stop string as the stop reason.

    While the request runs, the last token goes through its text stream: constant work per
    token (re-decoding the whole output each time made a long output quadratic). The token that
    finishes it has the whole output decoded once, as a single decode gives it: a stop or EOS
    token that ended the request is not part of the text (a stream chunk may hold bytes of
    earlier tokens, so it cannot simply be dropped), nor is a stop string, unless the request
    asks for include_stop_str_in_output; a character left incomplete shows as U+FFFD.
    """
    seq = state.seq
    include_stop = seq.params.include_stop_str_in_output
    previous = len(state.text)
    if reason is None:
        if state.text_stream is None:
            state.text_stream = decoder.decode_stream()
        state.text += state.text_stream.step(seq.token_ids[-1]) or ""
    else:
        ids = seq.output_token_ids
        if reason == "stop" and ids and not include_stop:
            ids = ids[:-1]
        state.text = decoder.decode(ids)
    stops = seq.params.stop
    if stops and seq.num_output_tokens > seq.params.min_tokens:  # vLLM: none before min_tokens
        match = find_stop_match(state.text, stops, stop_search_start(previous, stops))
        if match is not None:
            index, stop = match
            state.text = state.text[: index + len(stop) if include_stop else index]
            seq.stop_reason = stop
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
    prompt_logprobs = None
    if seq.wants_prompt_logprobs and not state.is_prompt_logprobs_sent:
        prompt_logprobs, state.is_prompt_logprobs_sent = state.prompt_logprobs, True
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
        stop_reason=seq.stop_reason if is_finished else None,
        prompt_logprobs=prompt_logprobs,
    )
