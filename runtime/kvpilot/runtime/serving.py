"""The server's state and request handling between HTTP (server.py) and the engine.

`ServerState` owns the engine's lifecycle (load in the background, drain on SIGTERM) and admission
(`--max-waiting`); `prepare_*` turn a validated request into token ids and SamplingParams, checking
everything the engine would reject so that it becomes a 400 rather than a failure mid-stream;
`collect` and `stream_events` turn engine outputs into OpenAI responses and SSE chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from kvpilot.runtime import responses
from kvpilot.runtime.api_errors import ApiError
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine import AsyncEngine, Engine, RequestOutput
from kvpilot.runtime.fetch import fetch
from kvpilot.runtime.grammar import GrammarError
from kvpilot.runtime.memory import BLOCK_SIZE
from kvpilot.runtime.metrics import CacheInfo, ServerMetrics, Snapshot
from kvpilot.runtime.protocol import (
    GREEDY_EPSILON,
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
)
from kvpilot.runtime.sampling import SamplingParams
from kvpilot.runtime.serve_config import ServeConfig
from kvpilot.runtime.structured import GrammarSpec
from kvpilot.runtime.tokenization import chat_prompt_ids, check_in_vocab, text_prompt_ids
from kvpilot.runtime.tokenizer import Tokenizer
from kvpilot.runtime.tool_calls import PARSERS, ToolCallParser, parser_name

log = logging.getLogger("kvpilot.server")
MIN_TOP_P = 1e-8
T = TypeVar("T")


def engine_config(config: ServeConfig, model_dir: str) -> EngineConfig:
    """The engine's fields of the serve config (the same names), with the model as a directory."""
    values = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    return EngineConfig(**{**values, "model": model_dir})


def local_model_dir(config: ServeConfig) -> str:
    """`--model` as a directory: hf:// and s3:// are fetched first (into HF_HOME's cache)."""
    source = config.source
    return str(fetch(source, None).path) if source.is_fetched else config.model


def cache_info(config: ServeConfig, core: Engine) -> CacheInfo:
    return CacheInfo(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=core.block_manager.num_total_blocks,
        cache_dtype=config.kv_cache_dtype,
        enable_prefix_caching=config.enable_prefix_caching,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )


class Ticket:
    """One admitted request's sequences in the in-flight count; `release` is idempotent."""

    def __init__(self, state: ServerState, num_seqs: int = 1):
        self.state, self.num_seqs, self.is_released = state, num_seqs, False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.state.num_in_flight -= self.num_seqs
            if self.state.num_in_flight == 0:
                self.state.idle.set()


class ServerState:
    def __init__(self, config: ServeConfig, engine: AsyncEngine | None = None):
        self.config = config
        self.served_name = config.served_name
        self.engine = engine
        self.engine_core: Engine | None = engine.engine if engine else None
        self.max_model_len = self.engine_core.max_model_len if self.engine_core else 0
        self.is_draining = False
        self.load_error: str | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        self.num_in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.active: set[str] = set()  # request ids in the engine, for abort at drain timeout
        self.metrics = ServerMetrics(config.served_name, self.snapshot)
        # Tokenising and rendering chat templates run here, off the event loop, so /health and
        # running streams are not held up by a long prompt. Two threads: the work is bounded by
        # the character check and mostly GIL-free (tokenizer.py), and more threads would only
        # compete with the engine's step thread for the GIL.
        self.prompt_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpilot-prompt")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

    async def load(self) -> None:
        """Load the model off the event loop so /health answers meanwhile."""
        try:
            model_dir = await asyncio.to_thread(local_model_dir, self.config)
            core = await asyncio.to_thread(Engine, engine_config(self.config, model_dir))
        except Exception as exc:  # any load failure ends the process with its message
            self.load_error = f"cannot load model {self.config.model}: {exc}"
            log.error(self.load_error)
            self.on_fatal()
            return
        engine = AsyncEngine(core)
        engine.add_step_listener(self.metrics.on_step)
        self.metrics.on_engine_ready(core.max_model_len, cache_info(self.config, core))
        await engine.start()
        self.engine_core, self.max_model_len, self.engine = core, core.max_model_len, engine
        log.info(
            "model %s loaded; ready (KV cache %s, %d blocks of %d tokens)",
            self.served_name,
            str(core.kv_dtype).removeprefix("torch."),
            core.block_manager.num_total_blocks,
            BLOCK_SIZE,
        )

    async def close(self) -> None:
        self.prompt_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            await self.engine.stop()
        if self.engine_core is not None:
            self.engine_core.shutdown()  # reaps the tensor-parallel workers, if any

    def snapshot(self) -> Snapshot:
        if self.engine is None:
            return Snapshot(0, 0, 0.0, 0, 0, 0, 0, 0)
        s = self.engine.stats()
        return Snapshot(
            s.num_waiting,
            s.num_running,
            s.kv_cache_usage,
            s.num_total_blocks,
            s.num_free_blocks,
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
        )

    def admit(self, num_seqs: int = 1) -> Ticket:
        """A place for one request of `num_seqs` sequences (n choices x prompts), or 429 when
        they would queue past --max-waiting.

        Counted in sequences from the server's own in-flight number, not the engine's last-step
        snapshot, so a burst between two steps cannot overshoot: at most max_num_seqs +
        max_waiting sequences (and their prompts) are ever held, or one request's when it
        arrives at an idle server.
        """
        if self.engine is None:
            raise ApiError(503, "model is still loading")
        num_queued = self.num_in_flight - self.config.max_num_seqs
        if self.num_in_flight and num_queued + num_seqs > self.config.max_waiting:
            raise ApiError(429, f"server overloaded: {num_queued} sequences already waiting")
        self.num_in_flight += num_seqs
        self.idle.clear()
        return Ticket(self, num_seqs)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let accepted requests finish, abort what is left at the timeout."""
        self.is_draining = True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
            return
        except TimeoutError:
            log.warning("drain timeout: aborting %d requests", len(self.active))
        if self.engine is not None:
            for request_id in list(self.active):
                self.engine.abort(request_id)
        try:  # aborted requests end within a step or two
            await asyncio.wait_for(self.idle.wait(), 10)
        except TimeoutError:
            log.warning("requests still open after abort; exiting anyway")


@dataclass
class Choice:
    """One sequence of a response: choice `index` of prompt `index // n`."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # completions with echo=true: prompt text before the output
    request_id: str = ""  # the engine's id of this sequence, set by its Job
    is_prompt_only: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as asked


@dataclass
class Job:
    chat: bool
    model: str
    choices: list[Choice]  # prompt-major: prompt i's n choices are i*n .. i*n + n - 1
    stream: bool
    include_usage: bool
    n: int = 1
    tool_parser: ToolCallParser | None = None  # chat with tools: calls are parsed out
    request_id: str = ""
    created: int = 0
    arrival: float = field(default_factory=time.perf_counter)  # TTFT and e2e count from here

    def __post_init__(self) -> None:
        self.request_id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = now()
        for choice in self.choices:
            is_single = len(self.choices) == 1
            choice.request_id = (
                self.request_id if is_single else f"{self.request_id}-{choice.index}"
            )

    @property
    def firsts(self) -> list[Choice]:
        """Each prompt's first choice: usage counts a prompt once however many choices it has."""
        return self.choices[:: self.n]


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
    return job


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
        rid: responses.Tracker(state.metrics, job.arrival, len(choice.prompt_ids))
        for rid, choice in by_id.items()
    }
    state.active.update(by_id)
    requests = [(c.prompt_ids, c.params, c.request_id) for c in job.choices]
    try:
        async for out in engine.generate_many(requests):
            trackers[out.request_id].on_output(out)
            yield by_id[out.request_id], out
    finally:
        state.active.difference_update(by_id)
        for tracker in trackers.values():
            tracker.close()


async def collect(state: ServerState, job: Job) -> dict[str, Any]:
    decoder = _core(state).tokenizer
    accumulators = {
        choice.index: responses.Accumulator(job, choice, decoder) for choice in job.choices
    }
    async for choice, out in outputs(state, job):
        accumulators[choice.index].add(out)
    return responses.response(job, list(accumulators.values()))


async def stream_events(state: ServerState, job: Job, ticket: Ticket) -> AsyncIterator[str]:
    """SSE: chunks of every choice as their tokens come, usage if asked, then `data: [DONE]`."""
    decoder = _core(state).tokenizer
    builders = {
        choice.index: responses.ChunkBuilder(job, choice, decoder) for choice in job.choices
    }
    try:
        if job.chat:
            for builder in builders.values():
                yield responses.sse(builder.role())
        async for choice, out in outputs(state, job):
            chunk = builders[choice.index].chunk(out)
            if chunk is not None:
                yield responses.sse(chunk)
        if job.include_usage:
            yield responses.sse(responses.usage_chunk(job, [b.last for b in builders.values()]))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the engine failed mid-stream: headers are out, tell the client
        log.exception("stream %s failed", job.request_id)
        yield responses.sse(error_body(f"generation failed: {exc}", "InternalServerError"))
        yield "data: [DONE]\n\n"
    finally:
        ticket.release()
