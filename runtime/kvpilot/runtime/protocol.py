"""OpenAI-compatible request and response models (the subset kvpilot serves).

Validation lives here so every bad input becomes a 400 naming its field before the engine sees it.
Unknown request fields are ignored, as OpenAI's and vLLM's servers do, so newer clients still work.
Every field a request model declares is honoured; the known OpenAI/vLLM fields this runtime does
not honour are listed in NOT_HONOURED, and a request that sets one to anything but a value that
asks for nothing is a 400 naming it, because silently returning something else than asked is
worse than a clear error. tests/server/test_every_field.py proves both halves, field by field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvpilot.runtime.structured import (
    ANY_JSON_OBJECT,
    GrammarSpec,
    choice_spec,
    grammar_spec,
    json_schema_spec,
    regex_spec,
)
from kvpilot.runtime.token_ids import TokenIds, has_negative

MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit on choices per prompt
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_SEED = 2**63 - 1
# Below this a temperature is greedy: dividing logits by ~1e-300 would overflow to inf/nan.
GREEDY_EPSILON = 1e-5


# Known OpenAI / vLLM request fields this runtime does not honour, each with the values that ask
# for nothing (null is always fine). Any other value is a 400 naming the field. A name is checked
# on every request model that does not declare it (completions declares `echo`, so only chat's
# `echo` is refused). When a feature lands: declare its field on the model, remove it here.
NOT_HONOURED: dict[str, tuple[object, ...]] = {
    # sampling
    "best_of": (1,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "truncate_prompt_tokens": (),
    # output
    "suffix": ("",),
    "echo": (False,),
    "prompt_logprobs": (),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    # tools: chat declares (honours) the first three; completions refuses them
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True,),
    "functions": ([],),
    "function_call": ("none", "auto"),
    # chat template
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "continue_final_message": (False,),
    "documents": ([],),
    # inputs and scheduling this runtime does not have
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "priority": (0,),
}


def asks_for_nothing(value: object, neutral: tuple[object, ...]) -> bool:
    """`value` equals one of the field's do-nothing values (True is not 1 here, as in JSON)."""
    return any(type(value) is type(n) or _both_numbers(value, n) for n in neutral if n == value)


def _both_numbers(a: object, b: object) -> bool:
    return all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))


def not_honoured_error(name: str, neutral: tuple[object, ...]) -> PydanticCustomError:
    allowed = f" (or send {json.dumps(neutral[0])})" if neutral else ""
    return PydanticCustomError(
        "not_supported",
        "{param}: this runtime does not support {param}; leave it out" + allowed,
        {"param": name},
    )


def refuse_not_honoured(data: dict[str, Any], declared: set[str]) -> None:
    for name, neutral in NOT_HONOURED.items():
        is_set = name in data and name not in declared
        if is_set and not asks_for_nothing(data[name], neutral):
            raise not_honoured_error(name, neutral)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # top-level bodies refuse the NOT_HONOURED names they do not declare; nested parts do not
    checks_not_honoured: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        """Text that is not valid Unicode and NOT_HONOURED fields are 400s naming the field;
        null means unset: clients send `"temperature": null` for "not set", as OpenAI accepts."""
        if not isinstance(data, dict):
            return data
        if (path := find_unencodable(data, "")) is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "{param}: the text is not valid Unicode (it holds a lone UTF-16 surrogate such "
                "as \\ud800, which no tokenizer can encode); send well-formed UTF-8 text",
                {"param": path},
            )
        data = {key: value for key, value in data.items() if value is not None}
        if cls.checks_not_honoured:
            refuse_not_honoured(data, set(cls.model_fields))
        return data


def find_unencodable(value: Any, path: str) -> str | None:
    """The path (e.g. 'messages.0.content') of the first string in a JSON value that cannot be
    encoded as UTF-8, or None. JSON's "\\ud800" escape decodes to such a string in Python."""
    if isinstance(value, str):
        return None if _is_encodable(value) else path
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        items = enumerate(value)  # a list of token ids is skipped whole: it has no text
    else:
        return None
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and not _is_encodable(key):
            return where
        if (found := find_unencodable(item, where)) is not None:
            return found
    return None


def _is_encodable(text: str) -> bool:
    if text.isascii():  # the common case, without copying the text
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(_Request):
    include_usage: bool = False


class _Strict(_Request):
    """A nested object whose every key we honour: an unknown key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# The output-constraint fields, at most one per request (a 400 names the second one given).
GRAMMAR_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    checks_not_honoured: ClassVar[bool] = True

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="vLLM extension; -1 or 0 disables")
    n: int = Field(1, ge=1, le=MAX_N, strict=True, description="choices per prompt")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, description="vLLM extension; 1 disables")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension")
    min_tokens: int = Field(0, ge=0, description="vLLM extension")
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = Field(False, description="vLLM extension, used by benchmarks")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension")
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extension")
    guided_regex: str | None = Field(None, description="vLLM extension")
    guided_choice: list[str] | None = Field(None, description="vLLM extension")
    guided_grammar: str | None = Field(None, description="vLLM extension")

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's shape: token ids as strings, biases in [-100, 100]."""
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and min(value) < 0:
            raise ValueError("token ids must be >= 0")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)  # an empty stop string would end every request at once

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def output_grammar(self) -> GrammarSpec | None:
        """The one output constraint asked for, or None; ValueError (message starting with the
        field) for two at once or an unusable one."""
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if isinstance(self.response_format, ResponseFormat) and self.response_format.type == "text":
            given.remove("response_format")  # plain text: no constraint
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one output constraint per request ({given})")
        return _grammar_of(self, given[0]) if given else None


def _grammar_of(body: _SamplingFields, name: str) -> GrammarSpec:
    value = getattr(body, name)
    if name == "response_format":
        if value.json_schema is None:
            return json_schema_spec(ANY_JSON_OBJECT, name)
        return json_schema_spec(value.json_schema.schema_, "response_format.json_schema.schema")
    if name == "structured_outputs":
        return _structured_outputs_grammar(value)
    build = {
        "guided_json": json_schema_spec,
        "guided_regex": regex_spec,
        "guided_choice": choice_spec,
        "guided_grammar": grammar_spec,
    }[name]
    return build(value, name)  # type: ignore[operator]


def _structured_outputs_grammar(value: StructuredOutputs) -> GrammarSpec:
    given = {k: v for k, v in value.model_dump(by_alias=True).items() if v not in (None, False)}
    if len(given) != 1:
        raise ValueError(
            "structured_outputs: give exactly one of json, regex, choice, grammar, json_object; "
            f"got {sorted(given) or 'none'}"
        )
    (key, item), source = next(iter(given.items())), f"structured_outputs.{next(iter(given))}"
    if key == "json_object":
        return json_schema_spec(ANY_JSON_OBJECT, source)
    build = {"json": json_schema_spec, "regex": regex_spec, "choice": choice_spec}
    return build.get(key, grammar_spec)(item, source)  # type: ignore[operator]


class CompletionRequest(_SamplingFields):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0, description="0 (with echo): score the prompt only")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM extension")

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt: Any) -> Any:
        """A prompt, or a batch of them: text or token ids, none empty, ids >= 0."""
        is_batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        prompts = prompt if is_batch else [prompt]
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise ValueError(f"must hold 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        for item in prompts:
            if isinstance(item, list) and (not item or has_negative(item)):
                raise ValueError("a token-id prompt must be non-empty, with ids >= 0")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, a single one as a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)
        return [cast(str | list[int], prompt)]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id ...) pass through to the chat template, as in HF.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls forced by tool_choice always match the parameters


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(True, description="vLLM extension")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(
        cls, choice: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        names = [tool.function.name for tool in info.data.get("tools") or []]
        if choice in ("required", None, "none", "auto"):
            if choice == "required" and not names:
                raise ValueError("'required' needs at least one tool in tools")
            return choice
        if not isinstance(choice, NamedToolChoice) or choice.function.name not in names:
            name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
            raise ValueError(f"function {name!r} is not among tools {names}")
        return choice

    def tool_functions(self) -> list[dict[str, Any]]:
        """The function definitions a call may use (all, or the named one); [] for none."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none" or not self.tools:
            return []
        functions = [tool.function.model_dump(exclude_none=True) for tool in self.tools]
        if isinstance(choice, NamedToolChoice):
            return [f for f in functions if f["name"] == choice.function.name]
        return functions

    def is_call_forced(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (one of them)."""

    checks_not_honoured: ClassVar[bool] = True

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = Field(True, description="with messages")
    add_special_tokens: bool = Field(
        True,
        description="add the tokenizer's special tokens (e.g. BOS) as the generation endpoints "
        "do; with messages a BOS the template writes is kept once",
    )
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` (text) or `messages` (a chat)")
        return self


class DetokenizeRequest(_Request):
    checks_not_honoured: ClassVar[bool] = True
    model: str | None = None
    tokens: TokenIds

    @field_validator("tokens")
    @classmethod
    def _non_negative_ids(cls, value: list[int]) -> list[int]:
        if value and has_negative(value):
            raise ValueError("token ids must be >= 0")
        return value


# ---- responses ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


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


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvpilot"
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


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, kind: str, param: str | None = None, code: str | int | None = None
) -> dict:
    info = ErrorInfo(message=message, type=kind, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def describe_validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for the first pydantic/FastAPI error, naming the field as OpenAI does."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}".strip(), None
    named = (first.get("ctx") or {}).get("param")
    if named is not None:  # a whole-body check that names the field itself (find_unencodable)
        return str(first.get("msg", "invalid value")), str(named)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # pydantic puts union member names (e.g. 'str', 'list[int]') in loc; they are not fields
    loc = [part for part in loc if not _is_type_name(part)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or "[" in part or part.startswith("function-")
