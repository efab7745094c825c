"""OpenAI-compatible response models: completions, chat, chunks, models, tokenize, errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ApiObject(BaseModel):
    """What every OpenAI object starts with: its id, its type (each subclass narrows `object` to
    its own literal) and when it was made, in Unix seconds."""

    id: str
    object: str
    created: int = Field(default_factory=now)


class ApiResponse(ApiObject):
    """A completion, a chat completion or a streamed chunk: the model that made it, its choices
    (each subclass narrows their type) and the token counts."""

    model: str
    choices: list[Any]
    usage: Usage | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def build(cls, prompt: int, completion: int, cached: int) -> Usage:
        details = PromptTokensDetails(cached_tokens=cached)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprobEntry(BaseModel):
    """vLLM's prompt_logprobs entry for one candidate token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it
    # vLLM: per prompt token (None for the first), token id -> entry, the prompt's token first
    prompt_logprobs: list[dict[str, PromptLogprobEntry] | None] | None = None


class CompletionResponse(ApiResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON object text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = []


class ChatChoiceBase(BaseModel):
    """What a chat choice and a streamed chunk's choice share (the message or delta is added)."""

    index: int = 0
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class ChatChoice(ChatChoiceBase):
    message: AssistantMessage


class ChatCompletionResponse(ApiResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None  # the next piece of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first has its id, type and name; the rest only add to
    the arguments. Sent without the null keys, as OpenAI does (clients merge the pieces)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionChunk(ApiResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(ApiObject):
    object: Literal["model"] = "model"
    owned_by: str = "kvpilot"
    root: str | None = None  # where the weights came from: --model, or a LoRA adapter's path
    parent: str | None = None  # a LoRA adapter's base model id (vLLM's field); None for the base
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class EngineChoices(BaseModel):
    """What the runtime chose for this machine at start-up, and why (the start-up log says the
    same): threads, compute dtype and the KV pool."""

    device: str
    threads: int  # each rank's share under tensor parallelism
    threads_source: str
    dtype: str
    cpu_has_bf16: bool
    quantization: str = "none"
    # A pre-quantised checkpoint's own scheme (config.json's quantization_config), e.g.
    # "compressed-tensors int4 (pack-quantized, group 128)"; None for a 16-bit checkpoint.
    checkpoint_quantization: str | None = None
    int8_kernel: str = "w8a16"  # what the int8 level runs (w8a8 or w8a16), whatever the level
    cpu_has_int8_dot: bool = False
    attention_backend: str = "sdpa"  # paged (the CPU kernel), flashinfer (CUDA) or sdpa
    attention_source: str = ""  # why that one
    kv_cache_dtype: str
    kv_cache_bytes: int
    kv_cache_blocks: int
    kv_cache_source: str
    weight_bytes: int
    speculative: str = "off"  # e.g. "ngram, up to 4 tokens, lookup 1-4"


class StartupReport(BaseModel):
    """This process's start-up (server/startup.py): when the kernel created it, and the seconds
    each phase added, in order (contract.metric_names.STARTUP_PHASES; those done so far while
    the model loads). The phases add up to the start: started_at + their sum is when /ready
    turned 200."""

    started_at: float  # unix seconds
    phases: dict[str, float]


class VersionResponse(BaseModel):
    version: str
    engine: EngineChoices | None = None  # None while the model loads
    startup: StartupReport


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str  # always a string, as OpenAI's (server/errors.py ERROR_CODES)


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, kind: str, param: str | None, code: str) -> dict:
    info = ErrorInfo(message=message, type=kind, param=param, code=code)
    return ErrorResponse(error=info).model_dump()
