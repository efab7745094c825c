"""Engine outputs -> OpenAI response bodies and SSE chunks, plus per-request latency metrics."""

from __future__ import annotations

import json
import time
import uuid
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
    FunctionCall,
    FunctionCallDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from kvpilot.runtime.tool_calls import ToolCall, ToolCallParser, call_head, parse

if TYPE_CHECKING:
    from kvpilot.runtime.serving import Job


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


def usage_of(out: RequestOutput | None, num_prompt: int) -> Usage:
    if out is None:
        return Usage.build(num_prompt, 0, 0)
    return Usage.build(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


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
    """A whole non-streamed response."""

    def __init__(self, job: Job, decoder: Decoder):
        self.job, self.decoder = job, decoder
        self.text = job.echo
        self.ids: list[int] = []
        self.lps: list[dict[int, float]] = []
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.ids += out.new_token_ids
        self.lps += out.logprobs or []
        self.last = out

    def response(self) -> dict[str, Any]:
        job, last = self.job, self.last
        reason = last.finish_reason if last else "abort"
        usage = usage_of(last, len(job.prompt_ids))
        if job.chat:
            logprobs = None
            if job.params.logprobs is not None:
                logprobs = chat_logprobs(self.decoder, self.ids, self.lps, job.params.logprobs)
            content: str | None = self.text
            calls: list[ToolCall] = []
            if job.tool_parser is not None:
                content, calls = parse(job.tool_parser, self.text)
            tool_calls = [tool_call_out(call) for call in calls]
            message = AssistantMessage(content=content, tool_calls=tool_calls)
            choice = ChatChoice(
                message=message,
                logprobs=logprobs,
                finish_reason=chat_finish_reason(reason, bool(calls)),
            )
            return ChatCompletionResponse(
                id=job.request_id,
                created=job.created,
                model=job.model,
                choices=[choice],
                usage=usage,
            ).model_dump()
        lp = None
        if job.params.logprobs is not None:
            lp = completion_logprobs(self.decoder, self.ids, self.lps, len(job.echo))
        choice_c = CompletionChoice(text=self.text, logprobs=lp, finish_reason=reason)
        return CompletionResponse(
            id=job.request_id, created=job.created, model=job.model, choices=[choice_c], usage=usage
        ).model_dump()


class ToolCallStream:
    """Splits a streamed chat output into content deltas and tool-call deltas, as OpenAI streams
    them: content until a call may begin; then per call a first delta with its id, name and the
    arguments so far, and the rest of the arguments as the model writes them. A call whose
    arguments cannot be followed as they come (not an object, or the name not first) is sent
    whole once complete. A call cut off by max_tokens stays as far as it was sent (the
    non-streamed response drops it, or returns the text as content if it was the only one)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_sent_chars = 0
        self.num_sent_calls = 0  # calls sent to their end
        self.open_id: str | None = None  # the call being streamed, once its first delta is out
        self.num_sent_args = 0  # characters of its arguments sent

    def add(self, new_text: str, is_finished: bool) -> tuple[str, list[ToolCallDelta]]:
        self.text += new_text
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
    """SSE chunks of a streamed response."""

    def __init__(self, job: Job, decoder: Decoder):
        self.job, self.decoder = job, decoder
        self.tools = ToolCallStream(job.tool_parser) if job.tool_parser else None
        self.offset = 0
        self.last: RequestOutput | None = None
        self.is_echo_pending = bool(job.echo)
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        self.head = {
            "id": job.request_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
        }

    def role(self) -> dict[str, Any]:
        delta = DeltaMessage(role="assistant", content="")
        return self._chat([ChatChunkChoice(delta=delta)])

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        self.last = out
        if not out.new_text and not out.finished and not out.logprobs:
            return None  # tokens held back (partial UTF-8 or a possible stop string)
        reason = out.finish_reason if out.finished else None
        if self.tools is not None:
            return self._tool_chunk(self.tools, out, reason)
        if self.job.params.logprobs is None and not self.is_echo_pending:
            return self._plain(out.new_text, reason)
        ids, lps = out.new_token_ids, out.logprobs or []
        if self.job.chat:
            logprobs = None
            if self.job.params.logprobs is not None:
                logprobs = chat_logprobs(self.decoder, ids, lps, self.job.params.logprobs)
            choice = ChatChunkChoice(
                delta=DeltaMessage(content=out.new_text), logprobs=logprobs, finish_reason=reason
            )
            return self._chat([choice])
        text = out.new_text
        if self.is_echo_pending:
            text, self.is_echo_pending = self.job.echo + text, False
        lp = None
        if self.job.params.logprobs is not None:
            lp = completion_logprobs(
                self.decoder, ids, lps, self.offset + len(text) - len(out.new_text)
            )
        self.offset += len(text)
        choice_c = CompletionChoice(text=text, logprobs=lp, finish_reason=reason)
        return self._completion([choice_c])

    def _tool_chunk(
        self, tools: ToolCallStream, out: RequestOutput, reason: str | None
    ) -> dict[str, Any] | None:
        content, calls = tools.add(out.new_text, out.finished)
        logprobs = None
        if self.job.params.logprobs is not None:
            lps = out.logprobs or []
            logprobs = chat_logprobs(self.decoder, out.new_token_ids, lps, self.job.params.logprobs)
        if not content and not calls and not out.finished and logprobs is None:
            return None
        delta = DeltaMessage(content=content or None)
        finish = chat_finish_reason(reason, tools.num_sent_calls > 0)
        chunk = self._chat([ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)])
        if calls:  # without null keys: clients merge a call's pieces key by key
            chunk["choices"][0]["delta"]["tool_calls"] = [
                call.model_dump(exclude_none=True) for call in calls
            ]
        return chunk

    def _plain(self, text: str, reason: str | None) -> dict[str, Any]:
        """The hot path (one chunk per sequence per step): plain dicts, same JSON as the models."""
        self.offset += len(text)
        key, value = ("delta", {"content": text}) if self.job.chat else ("text", text)
        choice = {"index": 0, key: value, "logprobs": None, "finish_reason": reason}
        return {**self.head, "choices": [choice], "usage": None}

    def usage(self) -> dict[str, Any]:
        usage = usage_of(self.last, len(self.job.prompt_ids))
        if self.job.chat:
            return self._chat([], usage)
        return self._completion([], usage)

    def _chat(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        job = self.job
        return ChatCompletionChunk(
            id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
        ).model_dump()

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict:
        job = self.job
        return CompletionResponse(
            id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
        ).model_dump()
