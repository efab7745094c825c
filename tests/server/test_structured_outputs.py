"""Structured outputs and tool calls through a real server on tiny-llama, with the `openai`
client: every output matches its schema, regex or choice; forced tool calls are always valid."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.server_process import MODEL, RuntimeServer

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "Describe the item as JSON."}]
NUM_SCHEMAS = 50
MAX_TOKENS = 200  # every schema below is bounded well within this


@pytest.fixture(scope="module")
def server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    return start_server("--max-model-len", "512", "--max-num-seqs", "64")


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def bounded_schema(i: int) -> dict[str, Any]:
    """Fifty different schemas whose every value is bounded (enums, ranges, maxLength,
    maxItems), so even a random-ish small model finishes them within MAX_TOKENS."""
    properties: dict[str, Any] = {
        f"id_{i}": {"type": "integer", "minimum": i, "maximum": i + 100},
        "kind": {"enum": [f"k{i}", f"k{i + 1}", "other"]},
    }
    if i % 2:
        properties["label"] = {"type": "string", "maxLength": 1 + i % 7}
    if i % 3 == 0:
        properties["tags"] = {
            "type": "array",
            "items": {"enum": ["a", "b", "c"]},
            "maxItems": 1 + i % 3,
        }
    if i % 5 == 0:
        properties["flag"] = {"type": "boolean"}
    if i % 7 == 0:
        properties["child"] = {
            "type": "object",
            "properties": {"depth": {"type": "integer", "minimum": 0, "maximum": 3}},
            "required": ["depth"],
            "additionalProperties": False,
        }
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def test_fifty_schemas_in_one_batch_all_validate(server: RuntimeServer) -> None:
    async def one(client: AsyncOpenAI, i: int) -> tuple[dict[str, Any], str, str | None]:
        schema = bounded_schema(i)
        response_format: Any = {
            "type": "json_schema",
            "json_schema": {"name": f"item_{i}", "schema": schema, "strict": True},
        }
        response = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=response_format,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=i,
        )
        choice = response.choices[0]
        return schema, choice.message.content or "", choice.finish_reason

    async def all_at_once() -> list[tuple[dict[str, Any], str, str | None]]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_SCHEMAS)))

    results = asyncio.run(all_at_once())
    assert len({json.dumps(schema) for schema, _, _ in results}) == NUM_SCHEMAS
    for schema, text, reason in results:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema)
    assert server.metrics()["kvpilot_requests_running"] == 0


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"guided_regex": r"[A-Z][a-z]{2,5}-[0-9]{2}"}, r"[A-Z][a-z]{2,5}-[0-9]{2}"),
        ({"structured_outputs": {"regex": r"(red|blue) [0-9]"}}, r"(red|blue) [0-9]"),
        ({"guided_choice": ["north", "south", "east"]}, r"north|south|east"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ({"structured_outputs": {"grammar": 'start: "x" /[0-9]/ "y"'}}, r"x[0-9]y"),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_regex_choice_and_grammar(
    client: OpenAI, extra: dict[str, Any], pattern: str, endpoint: str
) -> None:
    for seed in range(3):
        if endpoint == "chat":
            response = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=30, seed=seed, extra_body=extra
            )
            text, reason = response.choices[0].message.content, response.choices[0].finish_reason
        else:
            completion = client.completions.create(
                model=MODEL, prompt="The answer:", max_tokens=30, seed=seed, extra_body=extra
            )
            text, reason = completion.choices[0].text, completion.choices[0].finish_reason
        assert re.fullmatch(pattern, text or ""), text
        assert reason == "stop"


def test_json_object_and_streaming(client: OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)
    schema = bounded_schema(21)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        extra_body={"guided_json": schema},
        max_tokens=MAX_TOKENS,
        stream=True,
        seed=5,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "a["}, "guided_regex", "unclosed character class"),
        ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "strin"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
            "strin",
        ),
        ({"structured_outputs": {"grammar": "start: ( "}}, "structured_outputs.grammar", ""),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "not permitted",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ],
)
def test_unusable_constraints_are_400_naming_the_field(
    client: OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert info.value.param == param, info.value.message
    assert words in info.value.message


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_calls_a_tool(tool_client: OpenAI, parallel: bool) -> None:
    for seed in range(4):
        response = tool_client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        choice = response.choices[0]
        calls = choice.message.tool_calls or []
        # Parallel calls may go on until max_tokens: the complete ones are returned, then the
        # one cut off as far as it was written.
        assert choice.finish_reason == "tool_calls" or parallel, choice
        assert calls and choice.finish_reason in ("tool_calls", "length"), choice
        assert parallel or len(calls) == 1
        if choice.finish_reason == "length":
            calls = calls[:-1]
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_calls_that_tool_streamed(tool_client: OpenAI) -> None:
    stream = tool_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    chunks = [c for c in stream if c.choices]
    pieces = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    assert first.function is not None and first.function.name == "get_time"
    assert first.id and first.id.startswith("call_") and first.type == "function"
    # The arguments stream as tiny-llama writes them: later pieces only add to them.
    assert rest and all(p.index == 0 and p.id is None and p.type is None for p in rest)
    arguments = "".join((p.function.arguments or "") if p.function else "" for p in pieces)
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_auto_and_none_leave_plain_text_as_content(tool_client: OpenAI, tool_choice: Any) -> None:
    """tiny-llama never writes a call on its own: its text stays content, ended by length."""
    response = tool_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=12,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_conversation_with_tool_results_is_accepted(tool_client: OpenAI) -> None:
    messages: Any = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = tool_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8
    )
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objectx"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400(tool_client: OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        tool_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.param == param, info.value.message
