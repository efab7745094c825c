"""Every field of every request model is honoured, and every name in NOT_HONOURED is refused.

HONOURED maps each declared field of each request model (found by walking the endpoint models'
annotations, so a new field or a new nested model fails `test_every_field_has_a_check` until it
gets a check) to a behavioural check against a real server on the tiny model, or, where the
effect cannot be seen in tiny-llama's output (it never emits EOS), to the engine's params that
the server's own request code builds.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from kvpilot.contract.engine_config import EngineConfig
from kvpilot.contract.serve_config import ServeConfig
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server import handling, lifecycle
from kvpilot.runtime.server.job import Job
from kvpilot.runtime.server.request_checks import NOT_HONOURED
from kvpilot.runtime.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
PROMPT = "Return a new"
MESSAGES = [{"role": "user", "content": "What does the sort method do?"}]
HOT = {"temperature": 1.5, "seed": 7}  # sampling that differs from greedy on this model


@dataclass
class Ctx:
    client: OpenAI
    url: str
    state: lifecycle.ServerState  # the server's request code over an in-process engine

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def tokenizer(self) -> Tokenizer:
        return handling.tokenizer_of(self.state)

    def count(self, **body: Any) -> list[int]:
        return list(self.post("/tokenize", body).json()["tokens"])


@dataclass
class Result:
    text: str
    finish_reason: str | None
    num_prompt: int
    num_output: int
    raw: Any


def generate(ctx: Ctx, chat: bool, **kwargs: Any) -> Result:
    if chat:
        kwargs.setdefault("messages", MESSAGES)
        resp = ctx.client.chat.completions.create(model=MODEL, **{"max_tokens": 12, **kwargs})
        choice = resp.choices[0]
        text, reason = choice.message.content or "", choice.finish_reason
    else:
        kwargs.setdefault("prompt", PROMPT)
        resp = ctx.client.completions.create(model=MODEL, **{"max_tokens": 12, **kwargs})
        text, reason = resp.choices[0].text, resp.choices[0].finish_reason
    assert resp.usage is not None
    return Result(text, reason, resp.usage.prompt_tokens, resp.usage.completion_tokens, resp)


def greedy(ctx: Ctx, chat: bool, **kwargs: Any) -> str:
    return generate(ctx, chat, temperature=0, **kwargs).text


def extra(**fields: Any) -> dict[str, Any]:
    """Fields the openai client has no keyword for go in `extra_body`."""
    return {"extra_body": fields}


# ---- checks of the fields both generation endpoints share -------------------------------------


def check_model(ctx: Ctx, chat: bool) -> None:
    with pytest.raises(openai.NotFoundError):
        generate(ctx, chat, **extra(model="not-" + MODEL))
    assert generate(ctx, chat).raw.model == MODEL


def check_temperature(ctx: Ctx, chat: bool) -> None:
    assert greedy(ctx, chat) == greedy(ctx, chat)
    assert generate(ctx, chat, **HOT).text != greedy(ctx, chat)


def check_top_k(ctx: Ctx, chat: bool) -> None:
    assert generate(ctx, chat, **HOT, **extra(top_k=1)).text == greedy(ctx, chat)


def check_top_p(ctx: Ctx, chat: bool) -> None:
    assert generate(ctx, chat, **HOT, top_p=1e-9).text == greedy(ctx, chat)


def check_seed(ctx: Ctx, chat: bool) -> None:
    first = generate(ctx, chat, **HOT).text
    assert generate(ctx, chat, **HOT).text == first
    assert generate(ctx, chat, temperature=1.5, seed=8).text != first


def check_stop(ctx: Ctx, chat: bool) -> None:
    text = greedy(ctx, chat)
    stop = text[4:7]
    stopped = generate(ctx, chat, temperature=0, stop=[stop])
    assert (stopped.text, stopped.finish_reason) == (text[: text.index(stop)], "stop")


def check_stop_token_ids(ctx: Ctx, chat: bool) -> None:
    full = generate(ctx, chat, temperature=0)
    stop_id = ctx.count(prompt=full.text, add_special_tokens=False)[2]
    stopped = generate(ctx, chat, temperature=0, **extra(stop_token_ids=[stop_id]))
    assert stopped.finish_reason == "stop" and stopped.num_output < full.num_output


def check_stream(ctx: Ctx, chat: bool) -> None:
    kwargs = {"temperature": 0, "max_tokens": 12, "stream": True, "model": MODEL}
    if chat:
        stream = ctx.client.chat.completions.create(messages=MESSAGES, **kwargs)  # type: ignore[call-overload]
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    else:
        stream = ctx.client.completions.create(prompt=PROMPT, **kwargs)  # type: ignore[call-overload]
        text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == greedy(ctx, chat)


def check_stream_options(ctx: Ctx, chat: bool) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 5, "stream": True, "model": MODEL, "temperature": 0}
    for include in (True, False):
        kwargs["stream_options"] = {"include_usage": include}
        chunks: list[Any] = list(
            ctx.client.chat.completions.create(messages=MESSAGES, **kwargs)  # type: ignore[arg-type]
            if chat
            else ctx.client.completions.create(prompt=PROMPT, **kwargs)
        )
        usage = chunks[-1].usage
        assert (usage.completion_tokens if usage else None) == (5 if include else None)


def check_ignore_eos(ctx: Ctx, chat: bool) -> None:
    # tiny-llama never samples EOS, so the effect is invisible in its output: check the params
    for value in (True, False):
        assert prepare(ctx, chat, ignore_eos=value).choices[0].params.ignore_eos is value
    assert generate(ctx, chat, **extra(ignore_eos=True)).num_output == 12


def check_user(ctx: Ctx, chat: bool) -> None:
    # OpenAI's end-user id for abuse monitoring: honoured by serving the request unchanged
    assert greedy(ctx, chat, user="user-1234") == greedy(ctx, chat)


def check_max_tokens(ctx: Ctx, chat: bool) -> None:
    # greedy: at temperature 1 a chat ends with EOS within 5 tokens ~3% of the time
    result = generate(ctx, chat, max_tokens=5, temperature=0)
    assert (result.num_output, result.finish_reason) == (5, "length")


def check_logprobs(ctx: Ctx, chat: bool) -> None:
    if chat:
        result = generate(ctx, chat, max_tokens=4, logprobs=True, temperature=0)
        content = result.raw.choices[0].logprobs.content
        assert [c.token for c in content] and len(content) == 4
        assert generate(ctx, chat, max_tokens=4).raw.choices[0].logprobs is None
        return
    result = generate(ctx, chat, max_tokens=4, logprobs=2, temperature=0)
    lp = result.raw.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def check_n(ctx: Ctx, chat: bool) -> None:
    choices = generate(ctx, chat, n=3, **HOT).raw.choices
    assert [c.index for c in choices] == [0, 1, 2]
    texts = [c.message.content if chat else c.text for c in choices]
    assert len(set(texts)) > 1


def penalty_check(name: str, value: float) -> Callable[[Ctx, bool], None]:
    def check(ctx: Ctx, chat: bool) -> None:
        plain = greedy(ctx, chat, max_tokens=32)
        assert greedy(ctx, chat, max_tokens=32, **extra(**{name: value})) != plain

    return check


def check_min_p(ctx: Ctx, chat: bool) -> None:
    assert generate(ctx, chat, **HOT, **extra(min_p=1.0)).text == greedy(ctx, chat)


def check_min_tokens(ctx: Ctx, chat: bool) -> None:
    full = generate(ctx, chat, temperature=0)
    stop_id = ctx.count(prompt=full.text, add_special_tokens=False)[2]
    fields = {"stop_token_ids": [stop_id], "ignore_eos": True}
    early = generate(ctx, chat, temperature=0, **extra(**fields))
    held = generate(ctx, chat, temperature=0, **extra(**fields, min_tokens=10))
    assert early.num_output < 10 <= held.num_output


def check_logit_bias(ctx: Ctx, chat: bool) -> None:
    forced = greedy(ctx, chat, logit_bias={"354": 100})
    assert forced == ctx.tokenizer().decode([354] * 12)


def check_include_stop_str_in_output(ctx: Ctx, chat: bool) -> None:
    text = greedy(ctx, chat)
    stop = text[4:7]
    kept = greedy(ctx, chat, stop=[stop], **extra(include_stop_str_in_output=True))
    assert kept == text[: text.index(stop) + len(stop)]


def check_prompt_logprobs(ctx: Ctx) -> None:
    result = generate(ctx, False, **extra(prompt_logprobs=1))
    entries = result.raw.choices[0].prompt_logprobs
    assert entries[0] is None and len(entries) == result.num_prompt
    assert generate(ctx, False).raw.choices[0].model_extra.get("prompt_logprobs") is None


def check_priority(ctx: Ctx, chat: bool) -> None:
    """This server schedules fcfs: priority 0 serves as without it, any other is refused as vLLM
    refuses it, naming the flag (test_rt_priority_server.py runs the priority policy)."""
    assert greedy(ctx, chat, **extra(priority=0)) == greedy(ctx, chat)
    path, body = (
        ("/v1/chat/completions", {"messages": MESSAGES})
        if chat
        else ("/v1/completions", {"prompt": PROMPT})
    )
    refused = ctx.post(path, {"model": MODEL, **body, "priority": -3})
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "priority")
    assert "--scheduling-policy priority" in error["message"]


def prepare(ctx: Ctx, chat: bool, **fields: Any) -> Job:
    if chat:
        body = ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": MESSAGES, **fields}
        )
        return handling.prepare_chat(ctx.state, body)
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": PROMPT, **fields})
    return handling.prepare_completion(ctx.state, request)


SHARED: dict[str, Callable[[Ctx, bool], None]] = {
    "model": check_model,
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "seed": check_seed,
    "stop": check_stop,
    "stop_token_ids": check_stop_token_ids,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "ignore_eos": check_ignore_eos,
    "user": check_user,
    "max_tokens": check_max_tokens,
    "logprobs": check_logprobs,
    "n": check_n,
    "presence_penalty": penalty_check("presence_penalty", 2.0),
    "frequency_penalty": penalty_check("frequency_penalty", 2.0),
    "repetition_penalty": penalty_check("repetition_penalty", 2.0),
    "min_p": check_min_p,
    "min_tokens": check_min_tokens,
    "logit_bias": check_logit_bias,
    "include_stop_str_in_output": check_include_stop_str_in_output,
    "priority": check_priority,
}


# ---- checks of one endpoint's fields ----------------------------------------------------------


def check_prompt(ctx: Ctx) -> None:
    for prompt in (PROMPT, "def main():\n    return"):
        assert generate(ctx, False, prompt=prompt).num_prompt == len(ctx.count(prompt=prompt))
    ids = ctx.count(prompt=PROMPT)
    assert greedy(ctx, False, prompt=ids) == greedy(ctx, False)  # token ids are a prompt too


def check_echo(ctx: Ctx) -> None:
    assert greedy(ctx, False, echo=True) == PROMPT + greedy(ctx, False)


def check_messages(ctx: Ctx) -> None:
    other = [{"role": "user", "content": "Sort a list."}]
    for messages in (MESSAGES, other):
        result = generate(ctx, True, messages=messages)
        assert result.num_prompt == len(ctx.count(messages=messages))


def check_max_completion_tokens(ctx: Ctx) -> None:
    result = generate(ctx, True, max_completion_tokens=3, temperature=0)
    assert (result.num_output, result.finish_reason) == (3, "length")


def check_top_logprobs(ctx: Ctx) -> None:
    result = generate(ctx, True, max_tokens=3, logprobs=True, top_logprobs=3, temperature=0)
    assert [len(c.top_logprobs) for c in result.raw.choices[0].logprobs.content] == [3, 3, 3]


def check_add_generation_prompt(ctx: Ctx) -> None:
    with_prompt = generate(ctx, True).num_prompt
    without = generate(ctx, True, **extra(add_generation_prompt=False)).num_prompt
    assert without < with_prompt


def check_tokenize_model(ctx: Ctx) -> None:
    assert ctx.post("/tokenize", {"model": "nope", "prompt": "a"}).status_code == 404
    assert ctx.post("/tokenize", {"model": MODEL, "prompt": "a"}).status_code == 200


def check_tokenize_prompt(ctx: Ctx) -> None:
    assert ctx.count(prompt=PROMPT) == ctx.tokenizer().encode(PROMPT)


def check_tokenize_messages(ctx: Ctx) -> None:
    assert len(ctx.count(messages=MESSAGES)) == generate(ctx, True).num_prompt


def check_tokenize_add_generation_prompt(ctx: Ctx) -> None:
    with_prompt = ctx.count(messages=MESSAGES, add_generation_prompt=True)
    assert len(ctx.count(messages=MESSAGES, add_generation_prompt=False)) < len(with_prompt)


def check_tokenize_add_special_tokens(ctx: Ctx) -> None:
    assert ctx.count(prompt=PROMPT, add_special_tokens=False) == ctx.count(prompt=PROMPT)[1:]


def check_tokenize_return_token_strs(ctx: Ctx) -> None:
    answer = ctx.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert "Ġnew" in answer["token_strs"]
    assert ctx.post("/tokenize", {"prompt": PROMPT}).json().get("token_strs") is None


def check_detokenize_model(ctx: Ctx) -> None:
    assert ctx.post("/detokenize", {"model": "nope", "tokens": [1]}).status_code == 404
    assert ctx.post("/detokenize", {"model": MODEL, "tokens": [1]}).status_code == 200


def check_detokenize_tokens(ctx: Ctx) -> None:
    ids = ctx.count(prompt=PROMPT, add_special_tokens=False)
    assert ctx.post("/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}


def check_role(ctx: Ctx) -> None:
    as_system = [{"role": "system", "content": MESSAGES[0]["content"]}]
    assert ctx.count(messages=as_system) != ctx.count(messages=MESSAGES)
    bad = ctx.post("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.role"


def check_content_and_text(ctx: Ctx) -> None:
    text = MESSAGES[0]["content"]
    parts = [{"type": "text", "text": text[:9]}, {"type": "text", "text": text[9:]}]
    assert ctx.count(messages=[{"role": "user", "content": parts}]) == ctx.count(messages=MESSAGES)


def check_part_type(ctx: Ctx) -> None:
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    response = ctx.post("/tokenize", {"messages": [{"role": "user", "content": image}]})
    assert response.status_code == 400
    check_content_and_text(ctx)


# ---- structured outputs (both endpoints) and tool calls (chat) --------------------------------

ENUM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"pick": {"enum": ["left", "right"]}},
    "required": ["pick"],
    "additionalProperties": False,
}
PICKED = r'\{"pick":"(left|right)"\}'


def constrained(ctx: Ctx, chat: bool, pattern: str, **fields: Any) -> None:
    """Sampled output (so not by chance) matches `pattern` and ends with the grammar."""
    for seed in (1, 2):
        result = generate(ctx, chat, max_tokens=40, **HOT | {"seed": seed}, **extra(**fields))
        assert re.fullmatch(pattern, result.text), result.text
        assert result.finish_reason == "stop"


def json_object(ctx: Ctx, chat: bool, **fields: Any) -> None:
    """Any JSON object: unbounded, so tiny-llama may not close it within max_tokens; the object
    grammar is the one the request gets, and the output starts as an object, unlike free text."""
    grammar = prepare(ctx, chat, **fields).choices[0].params.grammar
    assert grammar is not None and json.loads(grammar.text) == {"type": "object"}
    assert generate(ctx, chat, **HOT, **extra(**fields)).text.startswith("{")
    assert not generate(ctx, chat, **HOT).text.startswith("{")


def check_response_format(ctx: Ctx, chat: bool) -> None:
    json_object(ctx, chat, response_format={"type": "json_object"})
    json_schema = {"name": "pick", "schema": ENUM_SCHEMA}
    format_ = {"type": "json_schema", "json_schema": json_schema}
    constrained(ctx, chat, PICKED, response_format=format_)
    assert prepare(ctx, chat, response_format={"type": "text"}).choices[0].params.grammar is None


def check_structured_outputs(ctx: Ctx, chat: bool) -> None:
    constrained(ctx, chat, "alpha|beta", structured_outputs={"choice": ["alpha", "beta"]})


def check_guided_json(ctx: Ctx, chat: bool) -> None:
    constrained(ctx, chat, PICKED, guided_json=ENUM_SCHEMA)


def check_guided_regex(ctx: Ctx, chat: bool) -> None:
    constrained(ctx, chat, "[0-9]{3}-[a-z]", guided_regex="[0-9]{3}-[a-z]")


def check_guided_choice(ctx: Ctx, chat: bool) -> None:
    constrained(ctx, chat, "yes|no", guided_choice=["yes", "no"])


def check_guided_grammar(ctx: Ctx, chat: bool) -> None:
    constrained(ctx, chat, "x[0-9]y", guided_grammar='start: "x" /[0-9]/ "y"')


def check_response_format_type(ctx: Ctx) -> None:
    kinds = {
        t: prepare(ctx, False, response_format={"type": t}).choices[0].params.grammar
        for t in ("text", "json_object")
    }
    assert kinds["text"] is None and kinds["json_object"] is not None
    check_response_format(ctx, False)


def check_json_schema_fields(ctx: Ctx) -> None:
    """name, description and strict are accepted; the schema is enforced, strict or not."""
    for strict in (True, False):
        json_schema = {
            "name": "p",
            "description": "a pick",
            "schema": ENUM_SCHEMA,
            "strict": strict,
        }
        constrained(
            ctx, True, PICKED, response_format={"type": "json_schema", "json_schema": json_schema}
        )


def check_structured_outputs_fields(ctx: Ctx) -> None:
    for fields, pattern in [
        ({"json": ENUM_SCHEMA}, PICKED),
        ({"regex": "[a-c]{4}"}, "[a-c]{4}"),
        ({"choice": ["one", "two"]}, "one|two"),
        ({"grammar": 'start: "v" /[0-9]/'}, "v[0-9]"),
    ]:
        constrained(ctx, False, pattern, structured_outputs=fields)
    json_object(ctx, False, structured_outputs={"json_object": True})


TOOL = {
    "type": "function",
    "function": {"name": "pick", "description": "Pick a side", "parameters": ENUM_SCHEMA},
}
OTHER_TOOL = {"type": "function", "function": {"name": "other", "parameters": ENUM_SCHEMA}}


def tool_calls(ctx: Ctx, **fields: Any) -> Any:
    result = generate(ctx, True, max_tokens=120, tools=[TOOL, OTHER_TOOL], **HOT, **fields)
    return result.finish_reason, result.raw.choices[0].message.tool_calls or []


def check_tools(ctx: Ctx) -> None:
    reason, calls = tool_calls(ctx, tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls" and len(calls) == 1
    assert json.loads(calls[0].function.arguments)["pick"] in ("left", "right")
    assert generate(ctx, True, tools=[TOOL]).raw.choices[0].message.content  # auto: text stays


def check_tool_choice(ctx: Ctx) -> None:
    named = {"type": "function", "function": {"name": "other"}}
    _, calls = tool_calls(ctx, tool_choice=named)
    assert [call.function.name for call in calls] == ["other"]
    assert prepare(ctx, True, tools=[TOOL], tool_choice="none").choices[0].params.grammar is None


def check_parallel_tool_calls(ctx: Ctx) -> None:
    def repeats(parallel: bool) -> bool:
        fields = {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": parallel}
        grammar = prepare(ctx, True, **fields).choices[0].params.grammar
        return grammar is not None and "call)*" in grammar.text

    assert repeats(True) and not repeats(False)
    check_tools(ctx)  # the single call parallel_tool_calls=false allows


def check_tool_definition(ctx: Ctx) -> None:
    """type and function: a function tool is called by name with arguments under its schema; a
    tool of another type is a 400 naming it."""
    bad = {**MINIMAL_CHAT, "tools": [{"type": "code", "function": TOOL["function"]}]}
    response = ctx.post("/v1/chat/completions", bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools.0.type"
    check_tool_choice(ctx)


def check_tool_description(ctx: Ctx) -> None:
    """The function definition reaches the chat template (tiny-llama's ignores tools, so a
    template that writes them shows it) and its parameters bind the forced call."""
    tok = ctx.tokenizer()
    template, tok.chat_template = tok.chat_template, "{{ tools | tojson }}{{ messages[0].content }}"
    try:
        plain = prepare(ctx, True, tools=[OTHER_TOOL]).choices[0].prompt_ids
        described = prepare(ctx, True, tools=[TOOL, OTHER_TOOL]).choices[0].prompt_ids
        assert len(described) > len(plain)
        assert "Pick a side" in tok.decode(described)
    finally:
        tok.chat_template = template
    check_tools(ctx)


MINIMAL_CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
STRUCTURED: dict[str, Callable[[Ctx, bool], None]] = {
    "response_format": check_response_format,
    "structured_outputs": check_structured_outputs,
    "guided_json": check_guided_json,
    "guided_regex": check_guided_regex,
    "guided_choice": check_guided_choice,
    "guided_grammar": check_guided_grammar,
}


def both(check: Callable[[Ctx, bool], None]) -> dict[str, Callable[[Ctx], None]]:
    return {
        "CompletionRequest": lambda ctx: check(ctx, False),
        "ChatCompletionRequest": lambda ctx: check(ctx, True),
    }


HONOURED: dict[tuple[str, str], Callable[[Ctx], None]] = {
    **{(model, name): fn for name, check in SHARED.items() for model, fn in both(check).items()},
    **{(m, name): fn for name, check in STRUCTURED.items() for m, fn in both(check).items()},
    ("CompletionRequest", "prompt"): check_prompt,
    ("CompletionRequest", "echo"): check_echo,
    ("CompletionRequest", "prompt_logprobs"): check_prompt_logprobs,
    ("ChatCompletionRequest", "messages"): check_messages,
    ("ChatCompletionRequest", "max_completion_tokens"): check_max_completion_tokens,
    ("ChatCompletionRequest", "top_logprobs"): check_top_logprobs,
    ("ChatCompletionRequest", "add_generation_prompt"): check_add_generation_prompt,
    ("StreamOptions", "include_usage"): lambda ctx: check_stream_options(ctx, False),
    ("ChatMessage", "role"): check_role,
    ("ChatMessage", "content"): check_content_and_text,
    ("TextPart", "type"): check_part_type,
    ("TextPart", "text"): check_content_and_text,
    ("TokenizeRequest", "model"): check_tokenize_model,
    ("TokenizeRequest", "prompt"): check_tokenize_prompt,
    ("TokenizeRequest", "messages"): check_tokenize_messages,
    ("TokenizeRequest", "add_generation_prompt"): check_tokenize_add_generation_prompt,
    ("TokenizeRequest", "add_special_tokens"): check_tokenize_add_special_tokens,
    ("TokenizeRequest", "return_token_strs"): check_tokenize_return_token_strs,
    ("DetokenizeRequest", "model"): check_detokenize_model,
    ("DetokenizeRequest", "tokens"): check_detokenize_tokens,
    ("ChatCompletionRequest", "tools"): check_tools,
    ("ChatCompletionRequest", "tool_choice"): check_tool_choice,
    ("ChatCompletionRequest", "parallel_tool_calls"): check_parallel_tool_calls,
    ("ResponseFormat", "type"): check_response_format_type,
    ("ResponseFormat", "json_schema"): check_json_schema_fields,
    **{
        ("JsonSchemaFormat", f): check_json_schema_fields
        for f in ("name", "description", "schema_", "strict")
    },
    **{
        ("StructuredOutputs", f): check_structured_outputs_fields
        for f in ("json_", "regex", "choice", "grammar", "json_object")
    },
    ("ToolDefinition", "type"): check_tool_definition,
    ("ToolDefinition", "function"): check_tool_definition,
    ("FunctionDefinition", "name"): check_tool_choice,
    ("FunctionDefinition", "description"): check_tool_description,
    ("FunctionDefinition", "parameters"): check_tools,
    ("FunctionDefinition", "strict"): check_tools,  # forced calls always match the parameters
    ("NamedToolChoice", "type"): check_tool_choice,
    ("NamedToolChoice", "function"): check_tool_choice,
    ("FunctionName", "name"): check_tool_choice,
}


def request_models() -> Iterator[type[BaseModel]]:
    """The endpoints' request models and every model nested in their fields."""
    seen: set[type[BaseModel]] = set()
    todo = list(ENDPOINTS.values())
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        yield model
        for info in model.model_fields.values():
            todo += [t for t in _types_in(info.annotation) if issubclass(t, BaseModel)]


def _types_in(annotation: Any) -> Iterator[type]:
    if isinstance(annotation, type):
        yield annotation
    for arg in typing.get_args(annotation):  # unions, list[...], dict[...]
        yield from _types_in(arg)


def test_every_field_has_a_check() -> None:
    declared = {(m.__name__, name) for m in request_models() for name in m.model_fields}
    assert declared == set(HONOURED), (
        f"fields without a check: {sorted(declared - set(HONOURED))}; "
        f"checks of fields that are gone: {sorted(set(HONOURED) - declared)}"
    )


def test_no_honoured_field_is_in_the_not_honoured_table() -> None:
    """A feature that lands declares its field and leaves NOT_HONOURED (completions' `echo` and
    `prompt_logprobs` are honoured there and refused on chat, which does not declare them; chat's
    tool fields likewise are refused on completions)."""
    both_ways = {(m, name) for m, name in HONOURED if name in NOT_HONOURED}
    chat_only = {
        ("ChatCompletionRequest", n) for n in ("tools", "tool_choice", "parallel_tool_calls")
    }
    completion_only = {("CompletionRequest", n) for n in ("echo", "prompt_logprobs")}
    assert both_ways == {*completion_only, *chat_only}


@pytest.fixture(scope="module")
def ctx(server: RuntimeServer) -> Ctx:
    state = lifecycle.ServerState(
        ServeConfig(model=str(TINY), served_name=MODEL, max_model_len=512)
    )
    state.engine_core = Engine(EngineConfig(model=str(TINY), max_model_len=512, max_num_seqs=8))
    state.max_model_len = 512
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return Ctx(client, server.url, state)


@pytest.mark.parametrize("key", sorted(HONOURED), ids=".".join)
def test_field_is_honoured(ctx: Ctx, key: tuple[str, str]) -> None:
    HONOURED[key](ctx)


MINIMAL_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
    "/tokenize": {"model": MODEL, "prompt": PROMPT},
    "/detokenize": {"model": MODEL, "tokens": [1]},
}
REFUSALS = [
    (path, name)
    for path, model in ENDPOINTS.items()
    for name in NOT_HONOURED
    if name not in model.model_fields
]


@pytest.mark.parametrize(("path", "name"), REFUSALS, ids=str)
def test_not_honoured_field_is_400_naming_it(ctx: Ctx, path: str, name: str) -> None:
    for value in ("something", 2, {"type": "json_object"}, [{"type": "function"}], True):
        if value in NOT_HONOURED[name] and type(value) is type(NOT_HONOURED[name][0]):
            continue
        response = ctx.post(path, {**MINIMAL_BODIES[path], name: value})
        assert response.status_code == 400, (name, value, response.text)
        error = response.json()["error"]
        assert error["param"] == name
        assert f"does not support {name}" in error["message"]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_values_that_ask_for_nothing_are_accepted(ctx: Ctx, path: str) -> None:
    body = dict(MINIMAL_BODIES[path])
    for name, neutral in NOT_HONOURED.items():
        if name not in ENDPOINTS[path].model_fields:
            body[name] = neutral[0] if neutral else None
    assert ctx.post(path, body).status_code == 200, ctx.post(path, body).text
