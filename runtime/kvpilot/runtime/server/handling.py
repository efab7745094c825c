"""Request handling between HTTP (server/app.py) and the engine.

`prepare_*` turn a validated request into token ids and SamplingParams, checking everything the
engine would reject so that it becomes a 400 rather than a failure mid-stream; `collect` and
`stream_events` turn engine outputs into OpenAI responses and SSE chunks. The server's state
(engine lifecycle, admission) is server/lifecycle.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from kvpilot.runtime.engine.engine import Engine, RequestOutput
from kvpilot.runtime.engine.grammar import GrammarError
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.structured import GrammarSpec
from kvpilot.runtime.engine.waiting_queue import check_priority
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server import rendering
from kvpilot.runtime.server.errors import ApiError
from kvpilot.runtime.server.job import Choice, Job
from kvpilot.runtime.server.lifecycle import ServerState, Ticket
from kvpilot.runtime.server.request_models import (
    GREEDY_EPSILON,
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
)
from kvpilot.runtime.server.response_models import error_body
from kvpilot.runtime.server.tokenizing import chat_prompt_ids, check_in_vocab, text_prompt_ids
from kvpilot.runtime.server.tool_calls import PARSERS, parser_name

log = logging.getLogger("kvpilot.server")
MIN_TOP_P = 1e-8


def choices_of(prompt_ids: list[int], params: SamplingParams, n: int, first: int) -> list[Choice]:
    """The n choices of one prompt; with a seed, choice j draws with seed + j (as vLLM does), so
    they differ and each is reproducible."""
    return [
        Choice(first + j, prompt_ids, params if params.seed is None else seeded(params, j))
        for j in range(n)
    ]


def seeded(params: SamplingParams, offset: int) -> SamplingParams:
    return replace(params, seed=((params.seed or 0) + offset) % (MAX_SEED + 1))


def prepare_completion(state: ServerState, body: CompletionRequest) -> Job:
    """Token ids and sampling params for a completion; slow on long text, so run off the loop."""
    tok = _core(state).tokenizer
    _check_priority(state, body)
    choices: list[Choice] = []
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            400, "max_tokens: 0 only scores the prompt, which needs echo=true", "max_tokens"
        )
    is_prompt_only = body.max_tokens == 0
    grammar = _output_grammar(body)
    for prompt in body.prompts():
        ids = _completion_ids(state, prompt)
        # Scoring the prompt alone still runs its prefill, which samples one token: dropped.
        requested = 1 if is_prompt_only else body.max_tokens
        max_tokens = _max_tokens(state, ids, requested, "prompt")
        params = sampling_params(body, max_tokens, body.logprobs, tok.vocab_size, grammar)
        params = replace(params, prompt_logprobs=prompt_logprobs_wanted(body))
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else tok.decode(ids)
        for choice in choices_of(ids, params, body.n, len(choices)):
            choice.echo, choice.is_prompt_only = echo, is_prompt_only
            choice.num_prompt_logprobs = body.prompt_logprobs
            choices.append(choice)
    return Job(False, body.model, choices, body.stream, body.include_usage(), body.n)


def prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """How many top logprobs the engine scores per prompt token: for vLLM's prompt_logprobs,
    and for echo with logprobs (OpenAI's legacy way: the prompt's tokens get logprobs too)."""
    wanted = [body.prompt_logprobs]
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    numbers = [n for n in wanted if n is not None]
    return max(numbers) if numbers else None


def _completion_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    tok = _core(state).tokenizer
    if isinstance(prompt, str):
        return text_prompt_ids(tok, prompt, state.max_model_len)
    # The length first: a prompt too long for the context is refused without walking its ids.
    _max_tokens(state, prompt, None, "prompt")
    check_in_vocab(tok.vocab_size, prompt, "prompt")
    return list(prompt)


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Job:
    """Token ids and sampling params for a chat; slow on long text, so run off the loop."""
    core = _core(state)
    tok = core.tokenizer
    _check_priority(state, body)
    functions = body.tool_functions()  # those a call may use: none with tool_choice "none"
    # Every tool reaches the template whatever tool_choice says, as in vLLM: "none" forbids
    # calls, it does not hide the tools from the model. Templates test `if tools`, as
    # transformers passes tools= only when given.
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    ids = chat_prompt_ids(
        tok, body.messages, body.add_generation_prompt, state.max_model_len, tools=tools
    )
    max_tokens = _max_tokens(state, ids, body.output_limit(), "messages")
    parser = PARSERS[parser_name(state.config.tool_call_parser, core.model_config.architecture)]
    grammar = _output_grammar(body)
    if body.is_call_forced():
        if grammar is not None:
            message = f"{grammar.source}: cannot be combined with a forced tool call"
            raise ApiError(400, message, grammar.source)
        is_parallel = body.parallel_tool_calls and body.tool_choice == "required"
        grammar = parser.grammar(functions, is_parallel)
    params = sampling_params(body, max_tokens, body.num_logprobs(), tok.vocab_size, grammar)
    choices = choices_of(ids, params, body.n, 0)
    job = Job(True, body.model, choices, body.stream, body.include_usage(), body.n)
    job.tool_parser = parser if functions else None
    job.is_call_forced = body.is_call_forced()
    return job


def _check_priority(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    """As vLLM: a priority under fcfs is refused, not ignored, so a client relying on it knows."""
    try:
        check_priority(body.priority, state.config.scheduling_policy)
    except ValueError as exc:
        raise ApiError(400, str(exc), "priority") from exc


def _output_grammar(body: CompletionRequest | ChatCompletionRequest) -> GrammarSpec | None:
    try:
        return body.output_grammar()
    except ValueError as exc:
        raise ApiError(400, str(exc), str(exc).split(":", 1)[0]) from exc


async def check_grammar(state: ServerState, job: Job) -> None:
    """Compile the job's grammar (off the event loop, into the engine's cache) so that a grammar
    that does not compile is a 400 naming its field, before any response starts. Every choice
    shares the one grammar the request asks for."""
    spec = job.choices[0].params.grammar
    if spec is None:
        return
    try:
        await asyncio.wrap_future(_core(state).grammar_compiler.compile(spec))
    except GrammarError as exc:
        raise ApiError(400, f"{spec.source}: {exc}", spec.source) from exc


def _core(state: ServerState) -> Engine:
    if state.engine_core is None:
        raise ApiError(503, "model is still loading")
    return state.engine_core


def core_of(state: ServerState) -> Engine:
    """The loaded engine (503 while it loads)."""
    return _core(state)


def tokenizer_of(state: ServerState) -> Tokenizer:
    return _core(state).tokenizer


def _max_tokens(state: ServerState, ids: list[int], requested: int | None, field: str) -> int:
    limit = state.max_model_len
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty after tokenisation", field)
    if len(ids) + 1 > limit:
        raise ApiError(
            400,
            f"{field}: {len(ids)} prompt tokens leave no room to generate in "
            f"this model's maximum context length of {limit} tokens",
            field,
        )
    if requested is None:
        return limit - len(ids)
    if len(ids) + requested > limit:
        raise ApiError(
            400,
            f"max_tokens: {len(ids)} prompt tokens + {requested} output tokens "
            f"exceed this model's maximum context length of {limit}",
            "max_tokens",
        )
    return requested


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    check_in_vocab(vocab_size, body.stop_token_ids or [], "stop_token_ids")
    check_in_vocab(vocab_size, [token for token, _ in body.logit_bias_pairs()], "logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            # below ~1e-5 dividing logits by the temperature overflows: that is greedy anyway
            temperature=0.0 if body.temperature < GREEDY_EPSILON else body.temperature,
            # a nucleus below 1e-8 holds only the top token for any vocabulary < 1e8 tokens, and
            # smaller values round to 0 in float32, which would leave no token at all
            top_p=max(body.top_p, MIN_TOP_P),
            top_k=0 if body.top_k >= vocab_size else body.top_k,  # >= vocab: no filter at all
            seed=body.seed,
            stop=body.stop_strings(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            logit_bias=body.logit_bias_pairs(),
            grammar=grammar,
            priority=body.priority,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), str(exc).split(" ", 1)[0]) from exc


async def outputs(state: ServerState, job: Job) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """The engine's outputs for every choice of `job`, interleaved as the steps make them,
    recording each sequence's latency metrics as they arrive."""
    engine = state.engine
    if engine is None:
        raise ApiError(503, "model is still loading")
    by_id = {choice.request_id: choice for choice in job.choices}
    trackers = {
        rid: rendering.Tracker(
            state.metrics, job.arrival, len(choice.prompt_ids), choice.params.priority
        )
        for rid, choice in by_id.items()
    }
    state.active.update(by_id)
    requests = [(c.prompt_ids, c.params, c.request_id) for c in job.choices]
    try:
        async for out in engine.generate_many(requests, job.lora):
            trackers[out.request_id].on_output(out)
            yield by_id[out.request_id], out
    finally:
        state.active.difference_update(by_id)
        for tracker in trackers.values():
            tracker.close()


async def collect(state: ServerState, job: Job) -> dict[str, Any]:
    decoder = _core(state).tokenizer
    accumulators = {
        choice.index: rendering.Accumulator(job, choice, decoder) for choice in job.choices
    }
    async for choice, out in outputs(state, job):
        accumulators[choice.index].add(out)
    return rendering.response(job, list(accumulators.values()))


async def stream_events(state: ServerState, job: Job, ticket: Ticket) -> AsyncIterator[str]:
    """SSE: chunks of every choice as their tokens come, usage if asked, then `data: [DONE]`."""
    decoder = _core(state).tokenizer
    builders = {
        choice.index: rendering.ChunkBuilder(job, choice, decoder) for choice in job.choices
    }
    try:
        if job.chat:
            for builder in builders.values():
                yield rendering.sse(builder.role())
        async for choice, out in outputs(state, job):
            chunk = builders[choice.index].chunk(out)
            if chunk is not None:
                yield rendering.sse(chunk)
        if job.include_usage:
            yield rendering.sse(rendering.usage_chunk(job, [b.last for b in builders.values()]))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the engine failed mid-stream: headers are out, tell the client
        log.exception("stream %s failed", job.request_id)
        failed = error_body(
            f"generation failed: {exc}", "InternalServerError", None, "internal_error"
        )
        yield rendering.sse(failed)
        yield "data: [DONE]\n\n"
    finally:
        ticket.release()
