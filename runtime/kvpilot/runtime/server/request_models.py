"""OpenAI-compatible request models (the subset kvpilot serves; responses:
server/response_models.py).

Validation lives here so every bad input becomes a 400 naming its field before the engine sees it.
Unknown request fields are ignored, as OpenAI's and vLLM's servers do, so newer clients still work.
Every field a request model declares is honoured; the known OpenAI/vLLM fields this runtime does
not honour are listed in request_checks.NOT_HONOURED, and a request that sets one to anything
but a value that asks for nothing is a 400 naming it, because silently returning something else
than asked is worse than a clear error. tests/server/test_every_field.py proves both halves,
field by field.
"""

from __future__ import annotations

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

from kvpilot.runtime.engine.structured import (
    ANY_JSON_OBJECT,
    GrammarSpec,
    choice_spec,
    grammar_spec,
    json_schema_spec,
    regex_spec,
)
from kvpilot.runtime.server.request_checks import (
    MAX_JSON_DEPTH,
    find_too_deep,
    find_unencodable,
    refuse_not_honoured,
)
from kvpilot.runtime.server.token_ids import TokenIds, has_negative

MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit on choices per prompt
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_SEED = 2**63 - 1
# Below this a temperature is greedy: dividing logits by ~1e-300 would overflow to inf/nan.
GREEDY_EPSILON = 1e-5


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
        if (path := find_too_deep(data)) is not None:
            raise PydanticCustomError(
                "too_deep",
                "{param}: JSON nested more than {max_depth} levels deep; send arrays and "
                "objects nested at most {max_depth} levels",
                {"param": path, "max_depth": MAX_JSON_DEPTH},
            )
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
    # int64 as vLLM's; any other value than 0 needs --scheduling-policy priority (handling.py)
    priority: int = Field(
        0,
        ge=-MAX_SEED - 1,
        le=MAX_SEED,
        description="vLLM extension: lower runs first under --scheduling-policy priority",
    )
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

    def num_prompts(self) -> int:
        return 1

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> _SamplingFields:
        """As OpenAI and vLLM: options for a stream that is not asked for are a mistake."""
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options_without_stream",
                "stream_options: only allowed with stream: true; set stream to true or leave "
                "stream_options out",
                {"param": "stream_options"},
            )
        return self

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

    def num_prompts(self) -> int:
        return len(self.prompts())

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


class LoadLoraAdapterRequest(_Request):
    """vLLM's /v1/load_lora_adapter body."""

    checks_not_honoured: ClassVar[bool] = True
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(
        min_length=1, description="directory, file://, hf://, s3:// or pvc:// URI"
    )


class UnloadLoraAdapterRequest(_Request):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is accepted; the name decides)."""

    checks_not_honoured: ClassVar[bool] = True
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
