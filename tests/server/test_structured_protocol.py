"""Each structured-output and tool field of the request models becomes one grammar spec, or a
validation error that names the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.runtime.engine.structured import GrammarSpec
from kvpilot.runtime.server.request_checks import describe_validation_error
from kvpilot.runtime.server.request_models import ChatCompletionRequest, CompletionRequest

COMPLETION = {"model": "m", "prompt": "hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_TEXT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
# The spec holds the schema read strictly: no properties but those it names (issue 40 item 16).
STRICT = GrammarSpec("json_schema", SCHEMA_TEXT[:-1] + ',"additionalProperties":false}')
ANY_OBJECT = GrammarSpec("json_schema", '{"type":"object"}')

GRAMMARS: list[tuple[dict[str, Any], GrammarSpec | None, str]] = [
    ({}, None, ""),
    ({"response_format": {"type": "text"}}, None, ""),
    ({"response_format": {"type": "json_object"}}, ANY_OBJECT, "response_format"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
            }
        },
        STRICT,
        "response_format.json_schema.schema",
    ),
    (
        {"structured_outputs": {"json": SCHEMA}},
        STRICT,
        "structured_outputs.json",
    ),
    # a schema given as text is the same spec (and cache entry) as the object
    (
        {"structured_outputs": {"json": SCHEMA_TEXT}},
        STRICT,
        "structured_outputs.json",
    ),
    (
        {"structured_outputs": {"regex": "[0-9]+"}},
        GrammarSpec("regex", "[0-9]+"),
        "structured_outputs.regex",
    ),
    (
        {"structured_outputs": {"choice": ["a", "b"]}},
        GrammarSpec("choice", '["a", "b"]'),
        "structured_outputs.choice",
    ),
    (
        {"structured_outputs": {"grammar": "start: /x+/"}},
        GrammarSpec("grammar", "start: /x+/"),
        "structured_outputs.grammar",
    ),
    ({"structured_outputs": {"json_object": True}}, ANY_OBJECT, "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, STRICT, "guided_json"),
    ({"guided_regex": "[a-z]"}, GrammarSpec("regex", "[a-z]"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, GrammarSpec("choice", '["yes", "no"]'), "guided_choice"),
    ({"guided_grammar": "start: /x/"}, GrammarSpec("grammar", "start: /x/"), "guided_grammar"),
]


@pytest.mark.parametrize("base", [COMPLETION, CHAT])
@pytest.mark.parametrize(("fields", "spec", "source"), GRAMMARS)
def test_each_field_is_one_grammar(
    base: dict[str, Any], fields: dict[str, Any], spec: GrammarSpec | None, source: str
) -> None:
    model = CompletionRequest if base is COMPLETION else ChatCompletionRequest
    got = model.model_validate({**base, **fields}).output_grammar()
    assert got == spec
    assert (got.source if got else "") == source


# (fields, the field the error names)
UNUSABLE: list[tuple[dict[str, Any], str]] = [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": "  "}, "guided_grammar"),
]


@pytest.mark.parametrize(("fields", "param"), UNUSABLE)
def test_unusable_constraints_name_their_field(fields: dict[str, Any], param: str) -> None:
    body = CompletionRequest.model_validate({**COMPLETION, **fields})
    with pytest.raises(ValueError, match=rf"^{param}\b"):
        body.output_grammar()


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
        "tools.0.function.extra",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_invalid_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, **fields})
    assert describe_validation_error(info.value.errors())[1] == param


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


@pytest.mark.parametrize(
    ("choice", "names", "is_forced"),
    [
        (None, ["f", "g"], False),  # tools given: auto
        ("auto", ["f", "g"], False),
        ("none", [], False),
        ("required", ["f", "g"], True),
        ({"type": "function", "function": {"name": "g"}}, ["g"], True),
    ],
)
def test_tool_choice_selects_functions(choice: Any, names: list[str], is_forced: bool) -> None:
    fields: dict[str, Any] = {"tools": TOOLS} | ({"tool_choice": choice} if choice else {})
    body = ChatCompletionRequest.model_validate({**CHAT, **fields})
    assert [f["name"] for f in body.tool_functions()] == names
    assert body.is_call_forced() == is_forced


def test_no_tools_means_no_functions() -> None:
    assert ChatCompletionRequest.model_validate(CHAT).tool_functions() == []
