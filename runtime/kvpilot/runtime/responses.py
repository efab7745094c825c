"""Engine outputs -> OpenAI response bodies and SSE chunks, plus per-request latency metrics."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from kvpilot.runtime.engine import RequestOutput
from kvpilot.runtime.metrics import ServerMetrics
from kvpilot.runtime.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprobEntry,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvpilot.runtime.sampling import PromptLogprob

if TYPE_CHECKING:
    from kvpilot.runtime.serving import Choice, Job


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Tracker:
    """TTFT, inter-token latency, e2e, phase times and token counts for one request."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt: int):
        self.metrics, self.arrival, self.last = metrics, arrival, arrival
        self.num_prompt, self.num_output = num_prompt, 0
        self.reason: str | None = None

    def on_output(self, out: RequestOutput) -> None:
        t = time.perf_counter()
        num_new = len(out.new_token_ids)
        if num_new and self.num_output == 0:
            self.metrics.ttft.observe(t - self.arrival)
            self.last = t
        elif num_new:
            for _ in range(num_new):  # tokens that arrive in one step share its latency
                self.metrics.itl.observe((t - self.last) / num_new)
            self.last = t
        self.num_output = out.num_output_tokens
        self.num_prompt = out.num_prompt_tokens
        if out.finished:
            self.reason = out.finish_reason or "stop"
            if out.times is not None:
                self.metrics.record_phases(out.times)

    def close(self) -> None:
        """At the end, whether finished or aborted because the client left."""
        e2e = time.perf_counter() - self.arrival
        self.metrics.record_finished(e2e, self.num_prompt, self.num_output, self.reason or "abort")


def usage_of(job: Job, lasts: list[RequestOutput | None]) -> Usage:
    """Usage of the whole job, as vLLM and OpenAI count it: each prompt (and its cached part)
    once however many choices it has, every choice's generated tokens."""
    by_index = dict(zip((choice.index for choice in job.choices), lasts, strict=True))
    num_prompt = num_cached = num_output = 0
    for choice in job.firsts:
        last = by_index[choice.index]
        num_prompt += last.num_prompt_tokens if last else len(choice.prompt_ids)
        num_cached += last.num_cached_tokens if last else 0
    num_output = sum(
        last.num_output_tokens
        for choice, last in zip(job.choices, lasts, strict=True)
        if last and not choice.is_prompt_only
    )
    return Usage.build(num_prompt, num_output, num_cached)


def completion_logprobs(
    decoder: Decoder, ids: list[int], lps: list[dict[int, float]], offset: int
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, top in zip(ids, lps, strict=False):
        text = decoder.decode([token_id])
        result.tokens.append(text)
        result.token_logprobs.append(top.get(token_id))
        result.top_logprobs.append({decoder.decode([t]): lp for t, lp in top.items()})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def echo_logprobs(
    decoder: Decoder, prompt_ids: list[int], scored: list[PromptLogprob], num_top: int
) -> CompletionLogprobs:
    """The prompt's tokens as OpenAI's legacy echo shows them: the first has nothing before it
    to be scored by, so its logprob and top logprobs are null."""
    tops: list[dict[int, float] | None] = [None]
    tops += [{s.token_id: s.logprob, **dict(list(s.top.items())[:num_top])} for s in scored]
    result, offset = CompletionLogprobs(), 0
    for token_id, top in zip(prompt_ids, tops, strict=False):
        text = decoder.decode([token_id])
        result.tokens.append(text)
        result.token_logprobs.append(top[token_id] if top else None)
        result.top_logprobs.append(
            {decoder.decode([t]): lp for t, lp in top.items()} if top else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def vllm_prompt_logprobs(
    decoder: Decoder, scored: list[PromptLogprob], num_top: int
) -> list[dict[str, PromptLogprobEntry] | None]:
    """vLLM's prompt_logprobs: per prompt token (null for the first) its own entry, then the
    num_top most likely tokens', keyed by token id."""
    result: list[dict[str, PromptLogprobEntry] | None] = [None]
    for s in scored:
        ranked = [(s.token_id, s.logprob, s.rank)]
        ranked += [(t, lp, rank) for rank, (t, lp) in enumerate(list(s.top.items())[:num_top], 1)]
        entry: dict[str, PromptLogprobEntry] = {}
        for token_id, logprob, rank in ranked:
            decoded = decoder.decode([token_id])
            entry.setdefault(str(token_id), PromptLogprobEntry(
                logprob=logprob, rank=rank, decoded_token=decoded))  # fmt: skip
        result.append(entry)
    return result


def chat_logprobs(
    decoder: Decoder, ids: list[int], lps: list[dict[int, float]], num_top: int
) -> ChatLogprobs:
    content = []
    for token_id, top in zip(ids, lps, strict=False):
        text = decoder.decode([token_id])
        ranked = sorted(top.items(), key=lambda item: -item[1])[:num_top]
        tops = [
            TopLogprob(token=(s := decoder.decode([t])), logprob=lp, bytes=list(s.encode()))
            for t, lp in ranked
        ]
        logprob = top.get(token_id, float("-inf"))
        content.append(
            TokenLogprob(
                token=text,
                logprob=max(logprob, -9999.0),
                bytes=list(text.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


class Accumulator:
    """One choice of a non-streamed response."""

    def __init__(self, job: Job, choice: Choice, decoder: Decoder):
        self.job, self.choice, self.decoder = job, choice, decoder
        self.text = choice.echo
        self.ids: list[int] = []
        self.lps: list[dict[int, float]] = []
        self.last: RequestOutput | None = None
        self.prompt_logprobs: list[PromptLogprob] = []

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        if self.choice.is_prompt_only:
            return  # the one token the prefill sampled is not part of the answer
        self.text += out.new_text
        self.ids += out.new_token_ids
        self.lps += out.logprobs or []
        self.last = out

    def chat_choice(self) -> ChatChoice:
        last, num_top = self.last, self.choice.params.logprobs
        logprobs = None
        if num_top is not None:
            logprobs = chat_logprobs(self.decoder, self.ids, self.lps, num_top)
        return ChatChoice(
            index=self.choice.index,
            message=AssistantMessage(content=self.text),
            logprobs=logprobs,
            finish_reason=last.finish_reason if last else "abort",
            stop_reason=last.stop_reason if last else None,
        )

    def completion_choice(self) -> CompletionChoice:
        last, choice, decoder = self.last, self.choice, self.decoder
        lp = None
        if choice.params.logprobs is not None:
            lp = completion_logprobs(decoder, self.ids, self.lps, len(choice.echo))
            if choice.echo:
                prompt = echo_logprobs(
                    decoder, choice.prompt_ids, self.prompt_logprobs, choice.params.logprobs
                )
                lp = joined(prompt, lp)
        prompt_logprobs = None
        if choice.num_prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(
                decoder, self.prompt_logprobs, choice.num_prompt_logprobs
            )
        return CompletionChoice(
            index=choice.index,
            text=self.text,
            logprobs=lp,
            finish_reason=last.finish_reason if last else "abort",
            stop_reason=last.stop_reason if last else None,
            prompt_logprobs=prompt_logprobs,
        )


def response(job: Job, accumulators: list[Accumulator]) -> dict[str, Any]:
    """The whole response: every choice in index order, usage summed."""
    usage = usage_of(job, [acc.last for acc in accumulators])
    if job.chat:
        return ChatCompletionResponse(
            id=job.request_id,
            created=job.created,
            model=job.model,
            choices=[acc.chat_choice() for acc in accumulators],
            usage=usage,
        ).model_dump()
    return completion_chunk(job, [acc.completion_choice() for acc in accumulators], usage)


class ChunkBuilder:
    """SSE chunks of one choice of a streamed response."""

    def __init__(self, job: Job, choice: Choice, decoder: Decoder):
        self.job, self.choice, self.decoder = job, choice, decoder
        self.offset = 0
        self.last: RequestOutput | None = None
        self.is_echo_pending = bool(choice.echo)
        self.prompt_logprobs: list[PromptLogprob] | None = None  # arrived, not yet sent
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        self.head = {
            "id": job.request_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
        }

    def role(self) -> dict[str, Any]:
        delta = DeltaMessage(role="assistant", content="")
        return chat_chunk(self.job, [ChatChunkChoice(index=self.choice.index, delta=delta)])

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.choice.is_prompt_only:  # the one token the prefill sampled is not sent
            out = replace(out, new_text="", new_token_ids=[], logprobs=None)
        if not out.new_text and not out.finished and not out.logprobs:
            return None  # tokens held back (partial UTF-8 or a possible stop string)
        reason = out.finish_reason if out.finished else None
        stop_reason, index = out.stop_reason, self.choice.index  # stop_reason: None until finished
        num_top = self.choice.params.logprobs
        if num_top is None and not self.is_echo_pending and self.prompt_logprobs is None:
            return self._plain(out.new_text, reason, stop_reason)
        ids, lps = out.new_token_ids, out.logprobs or []
        if self.job.chat:
            logprobs = None
            if num_top is not None:
                logprobs = chat_logprobs(self.decoder, ids, lps, num_top)
            choice = ChatChunkChoice(
                index=index,
                delta=DeltaMessage(content=out.new_text),
                logprobs=logprobs,
                finish_reason=reason,
                stop_reason=stop_reason,
            )
            return chat_chunk(self.job, [choice])
        text, is_echo = out.new_text, self.is_echo_pending
        if is_echo:
            text, self.is_echo_pending = self.choice.echo + text, False
        lp = None
        if num_top is not None:
            lp = completion_logprobs(
                self.decoder, ids, lps, self.offset + len(text) - len(out.new_text)
            )
            if is_echo:
                scored = self.prompt_logprobs or []
                lp = joined(
                    echo_logprobs(self.decoder, self.choice.prompt_ids, scored, num_top), lp
                )
        self.offset += len(text)
        choice_c = CompletionChoice(
            index=index, text=text, logprobs=lp, finish_reason=reason, stop_reason=stop_reason,
            prompt_logprobs=self._take_prompt_logprobs(),
        )  # fmt: skip
        return completion_chunk(self.job, [choice_c])

    def _take_prompt_logprobs(self) -> list[dict[str, PromptLogprobEntry] | None] | None:
        """vLLM's prompt_logprobs, in the first chunk after they arrive."""
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        num_top = self.choice.num_prompt_logprobs
        if scored is None or num_top is None:
            return None
        return vllm_prompt_logprobs(self.decoder, scored, num_top)

    def _plain(self, text: str, reason: str | None, stop_reason: str | int | None) -> dict:
        """The hot path (one chunk per sequence per step): plain dicts, same JSON as the models."""
        self.offset += len(text)
        key, value = ("delta", {"content": text}) if self.job.chat else ("text", text)
        choice = {
            "index": self.choice.index,
            key: value,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": stop_reason,
        }
        return {**self.head, "choices": [choice], "usage": None}


def usage_chunk(job: Job, lasts: list[RequestOutput | None]) -> dict[str, Any]:
    """The final chunk of a stream that asked for usage: no choices, the job's usage."""
    usage = usage_of(job, lasts)
    return chat_chunk(job, [], usage) if job.chat else completion_chunk(job, [], usage)


def chat_chunk(job: Job, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
    return ChatCompletionChunk(
        id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
    ).model_dump()


def completion_chunk(job: Job, choices: list[CompletionChoice], usage: Usage | None = None) -> dict:
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
    ).model_dump()
