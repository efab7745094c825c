"""Every bad request body maps to a validation error naming the offending field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.runtime.server.request_checks import (
    describe_validation_error,
    find_too_deep,
    find_unencodable,
)
from kvpilot.runtime.server.request_models import ChatCompletionRequest, CompletionRequest
from kvpilot.runtime.server.response_models import error_body

COMPLETION = {"model": "m", "prompt": "hello"}


def nested(depth: int) -> Any:
    """An array holding an object holding an array ... `depth` levels in all."""
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None]] = [
    ({"max_tokens": 0}, None),  # scores the prompt with echo; the server checks echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": True}, "n"),  # JSON true is not the number 1
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"the": 2.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 2.0}}, "logit_bias"),
    ({"logit_bias": {"1": 101.0}}, "logit_bias"),
    ({"stream": "sometimes"}, "stream"),
    ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"zz": nested(101)}, "zz"),  # an ignored field is still parsed: its depth counts
    ({"logit_bias": {"1": nested(100)}}, "logit_bias"),
    ({"prompt": ""}, None),  # empty text is a tokenisation question, decided by the server
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": None}, "prompt"),  # null means unset, and prompt is required
    ({"model": 3}, "model"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS)
def test_bad_completion_fields_name_the_field(patch: dict[str, Any], param: str | None) -> None:
    body = {**COMPLETION, **patch}
    if param is None:
        CompletionRequest.model_validate(body)
        return
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    message, named = describe_validation_error(info.value.errors())
    assert named == param, message
    assert message.startswith(f"{param}:")


def test_missing_required_fields_are_named() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x"})
    assert describe_validation_error(info.value.errors())[1] == "model"
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m"})
    assert describe_validation_error(info.value.errors())[1] == "messages"


BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    # A list of parts: the part at fault is named, not the string the content could have been.
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": "hello"}, "messages"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),  # served on /v1/completions only
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHATS)
def test_bad_chat_fields_name_the_field(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, **patch})
    message, named = describe_validation_error(info.value.errors())
    assert named == param, message


def test_an_image_part_is_refused_saying_what_the_part_should_be() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, "messages": messages})
    message, _ = describe_validation_error(info.value.errors())
    assert message == "messages.0.content.1.type: Input should be 'text'"


def test_top_logprobs_without_logprobs_is_rejected() -> None:
    with pytest.raises(ValidationError, match="top_logprobs requires logprobs"):
        ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": 2})


GOOD: list[tuple[dict[str, Any], list[str | list[int]]]] = [
    ({"prompt": "hi"}, ["hi"]),
    ({"prompt": ["hi"]}, ["hi"]),
    ({"prompt": ["hi", "there"]}, ["hi", "there"]),
    ({"prompt": [1, 2, 3]}, [[1, 2, 3]]),
    ({"prompt": [[4, 5]]}, [[4, 5]]),
    ({"prompt": [[4, 5], [6]]}, [[4, 5], [6]]),
]


@pytest.mark.parametrize(("patch", "prompts"), GOOD)
def test_prompt_shapes_are_batches_of_prompts(patch: dict[str, Any], prompts: object) -> None:
    assert CompletionRequest.model_validate({**COMPLETION, **patch}).prompts() == prompts


def test_defaults_and_helpers() -> None:
    req = CompletionRequest.model_validate(
        {
            **COMPLETION,
            "stop": ["", "\n"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.max_tokens == 16
    assert req.stop_strings() == ("\n",)
    assert req.include_usage()
    chat = ChatCompletionRequest.model_validate(
        {**CHAT, "max_completion_tokens": 7, "logprobs": True, "unknown_field": 1}
    )
    assert chat.output_limit() == 7
    assert chat.num_logprobs() == 0
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert (
        ChatCompletionRequest.model_validate({**CHAT, "messages": [parts]}).messages[0].text()
        == "ab"
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"a": nested(99)}, None),  # 100 levels with the body itself
        ({"a": nested(100)}, "a"),
        ({"a": 1, "b": [nested(98), {"c": nested(99)}]}, "b"),
        ({"a": [1, [[[[1]]]]]}, None),  # a list of token ids is not walked
        ({"a": "text"}, None),
    ],
)
def test_too_deep_names_the_field_holding_it(body: Any, field: str | None) -> None:
    assert find_too_deep(body) == field


def test_find_unencodable_walks_deep_bodies_without_recursion() -> None:
    body = {"a": nested(5000)}
    assert find_unencodable(body, "") is None
    assert find_unencodable({"a": [{"b": "ok"}, {"c\ud800": 1}]}, "") == "a.1.c\ud800"


def test_malformed_json_has_no_param() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json("{not json")
    message, param = describe_validation_error(info.value.errors())
    assert param is None
    assert message.startswith("malformed JSON")


def test_error_body_is_openai_shaped() -> None:
    body = error_body("max_tokens: too small", "invalid_request_error", "max_tokens", "bad")
    assert body == {
        "error": {
            "message": "max_tokens: too small",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "bad",
        }
    }


def test_null_fields_take_their_defaults() -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "max_tokens": None, "stop": None,
             "seed": None, "stream_options": None, "logprobs": None}  # fmt: skip
    req = CompletionRequest.model_validate({**COMPLETION, **nulls})
    assert (req.temperature, req.top_p, req.max_tokens) == (1.0, 1.0, 16)
    chat = ChatCompletionRequest.model_validate({**CHAT, **nulls, "top_logprobs": None})
    assert chat.output_limit() is None and chat.num_logprobs() is None


REALISTIC_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"echo": True}, "echo"),  # chat's echo; completions honour theirs
]


@pytest.mark.parametrize(("patch", "param"), REALISTIC_REFUSALS)
def test_not_honoured_fields_are_refused_naming_them(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, **patch})
    message, named = describe_validation_error(info.value.errors())
    assert named == param
    assert message.startswith(f"{param}: this runtime does not support {param}; leave it out")


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_tool_fields_are_refused_on_completions(patch: dict[str, Any], param: str) -> None:
    """Chat honours them (test_structured_protocol.py); completions have no tools."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({**COMPLETION, **patch})
    assert describe_validation_error(info.value.errors())[1] == param


def test_values_that_ask_for_nothing_pass() -> None:
    nothing = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {},
               "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
               "parallel_tool_calls": True, "echo": None, "unknown_new_field": 3}  # fmt: skip
    ChatCompletionRequest.model_validate({**CHAT, **nothing})
    CompletionRequest.model_validate({**COMPLETION, **nothing, "echo": True})
