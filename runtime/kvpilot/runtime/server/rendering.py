"""Engine outputs -> OpenAI response bodies and SSE chunks, plus per-request latency metrics."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any

from kvpilot.runtime.engine.output_processor import Decoder, RequestOutput
from kvpilot.runtime.engine.sampling import PromptLogprob
from kvpilot.runtime.server.job import Choice, Job
from kvpilot.runtime.server.metrics import ServerMetrics
from kvpilot.runtime.server.response_models import (
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
    FunctionCall,
    FunctionCallDelta,
    PromptLogprobEntry,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from kvpilot.runtime.server.tool_calls import (
    ToolCall,
    ToolCallParser,
    call_head,
    forced_calls,
    parse,
)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Tracker:
    """TTFT, inter-token latency, e2e, phase times and token counts for one request."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt: int, priority: int = 0):
        self.metrics, self.arrival, self.last = metrics, arrival, arrival
        self.priority = priority
        self.num_prompt, self.num_output = num_prompt, 0
        self.reason: str | None = None
        metrics.record_received()  # the arrival; close() always counts its end

    def on_output(self, out: RequestOutput) -> None:
        t = time.perf_counter()
        num_new = len(out.new_token_ids)
        if num_new and self.num_output == 0:
            self.metrics.record_ttft(t - self.arrival, self.priority)
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
                self.metrics.record_phases(out.times, self.priority, out.num_output_tokens)

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


# The least logprob a response states (vLLM's floor): a token the sampler could not pick (masked
# by a grammar, or pushed below float range by a penalty) has -inf, which JSON cannot carry;
# NaN (logits that overflowed) is stated the same way rather than failing the whole response.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN >= x is False


def json_logprobs(top: dict[int, float]) -> dict[int, float]:
    return {token_id: json_logprob(lp) for token_id, lp in top.items()}


def completion_logprobs(
    decoder: Decoder, ids: list[int], lps: list[dict[int, float]], offset: int
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, top in zip(ids, map(json_logprobs, lps), strict=False):
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
    tops += [
        json_logprobs({s.token_id: s.logprob, **dict(list(s.top.items())[:num_top])})
        for s in scored
    ]
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
                logprob=json_logprob(logprob), rank=rank, decoded_token=decoded))  # fmt: skip
        result.append(entry)
    return result


def chat_logprobs(
    decoder: Decoder, ids: list[int], lps: list[dict[int, float]], num_top: int
) -> ChatLogprobs:
    content = []
    for token_id, top in zip(ids, map(json_logprobs, lps), strict=False):
        text = decoder.decode([token_id])
        ranked = sorted(top.items(), key=lambda item: -item[1])[:num_top]
        tops = [
            TopLogprob(token=(s := decoder.decode([t])), logprob=lp, bytes=list(s.encode()))
            for t, lp in ranked
        ]
        content.append(
            TokenLogprob(
                token=text,
                logprob=top.get(token_id, LOGPROB_FLOOR),
                bytes=list(text.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments)
    )


def chat_finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A request that ended by itself after calling tools says so, as OpenAI does."""
    return "tool_calls" if has_calls and reason == "stop" else reason


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
        reason = last.finish_reason if last else "abort"
        logprobs = None
        if num_top is not None:
            logprobs = chat_logprobs(self.decoder, self.ids, self.lps, num_top)
        content: str | None = self.text
        calls: list[ToolCall] = []
        if self.job.tool_parser is not None and self.job.is_call_forced:
            content, calls = None, forced_calls(self.job.tool_parser, self.text)
        elif self.job.tool_parser is not None:
            content, calls = parse(self.job.tool_parser, self.text)
        tool_calls = [tool_call_out(call) for call in calls]
        return ChatChoice(
            index=self.choice.index,
            message=AssistantMessage(content=content, tool_calls=tool_calls),
            logprobs=logprobs,
            finish_reason=chat_finish_reason(reason, bool(calls)),
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


class ToolCallStream:
    """Splits a streamed chat output into content deltas and tool-call deltas, as OpenAI streams
    them: content until a call may begin; then per call a first delta with its id, name and the
    arguments so far, and the rest of the arguments as the model writes them. A call whose
    arguments cannot be followed as they come (not an object, or the name not first) is sent
    whole once complete. A call cut off by max_tokens stays as far as it was sent (the
    non-streamed response drops it, or returns the text as content if it was the only one);
    a forced call (`is_forced`: the output is only calls) is sent to where it was cut and
    never as content, as the non-streamed response gives it (tool_calls.forced_calls)."""

    def __init__(self, parser: ToolCallParser, is_forced: bool = False) -> None:
        self.parser = parser
        self.is_forced = is_forced
        self.text = ""
        self.num_sent_chars = 0
        self.num_sent_calls = 0  # calls sent to their end
        self.open_id: str | None = None  # the call being streamed, once its first delta is out
        self.num_sent_args = 0  # characters of its arguments sent

    def add(self, new_text: str, is_finished: bool) -> tuple[str, list[ToolCallDelta]]:
        self.text += new_text
        if self.is_forced and is_finished:  # the rest of the calls, the last maybe cut off
            written = forced_calls(self.parser, self.text)
            return "", [self._complete(call) for call in written[self.num_sent_calls :]]
        end = self.parser.content_end(self.text)
        tail = self.text[end:]
        calls = self.parser.calls(tail, is_finished) if tail else []
        if (calls is None or (is_finished and not calls)) and self.open_id is None:
            end, calls, tail = len(self.text), [], ""  # not calls after all: it is content
        calls = calls or []  # a call already partly sent stays a call, cut off where it ended
        content = self.text[self.num_sent_chars : max(end, self.num_sent_chars)]
        self.num_sent_chars = max(end, self.num_sent_chars)
        deltas = [self._complete(call) for call in calls[self.num_sent_calls :]]
        pending = self.parser.pending(tail) if tail and not is_finished else None
        head = call_head(pending) if pending else None
        if head is not None:
            deltas += self._partial(*head)
        return content, deltas

    def _complete(self, call: ToolCall) -> ToolCallDelta:
        index, self.num_sent_calls = self.num_sent_calls, self.num_sent_calls + 1
        if self.open_id is None:
            return ToolCallDelta(
                index=index,
                id=new_call_id(),
                type="function",
                function=FunctionCallDelta(name=call.name, arguments=call.arguments),
            )
        rest = call.arguments[self.num_sent_args :]
        self.open_id, self.num_sent_args = None, 0
        return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=rest))

    def _partial(self, name: str, arguments: str) -> list[ToolCallDelta]:
        index, new = self.num_sent_calls, arguments[self.num_sent_args :]
        self.num_sent_args = len(arguments)
        if self.open_id is None:
            self.open_id = new_call_id()
            function = FunctionCallDelta(name=name, arguments=arguments)
            return [ToolCallDelta(index=index, id=self.open_id, type="function", function=function)]
        return (
            [ToolCallDelta(index=index, function=FunctionCallDelta(arguments=new))] if new else []
        )


class ChunkBuilder:
    """SSE chunks of one choice of a streamed response."""

    def __init__(self, job: Job, choice: Choice, decoder: Decoder):
        self.job, self.choice, self.decoder = job, choice, decoder
        self.tools = (
            ToolCallStream(job.tool_parser, job.is_call_forced) if job.tool_parser else None
        )
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
        if self.tools is not None:
            return self._tool_chunk(self.tools, out, reason, stop_reason)
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

    def _tool_chunk(
        self,
        tools: ToolCallStream,
        out: RequestOutput,
        reason: str | None,
        stop_reason: str | int | None,
    ) -> dict[str, Any] | None:
        content, calls = tools.add(out.new_text, out.finished)
        num_top, logprobs = self.choice.params.logprobs, None
        if num_top is not None:
            logprobs = chat_logprobs(self.decoder, out.new_token_ids, out.logprobs or [], num_top)
        if not content and not calls and not out.finished and logprobs is None:
            return None
        choice = ChatChunkChoice(
            index=self.choice.index,
            delta=DeltaMessage(content=content or None),
            logprobs=logprobs,
            finish_reason=chat_finish_reason(reason, tools.num_sent_calls > 0),
            stop_reason=stop_reason,
        )
        chunk = chat_chunk(self.job, [choice])
        if calls:  # without null keys: clients merge a call's pieces key by key
            chunk["choices"][0]["delta"]["tool_calls"] = [
                call.model_dump(exclude_none=True) for call in calls
            ]
        return chunk

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
