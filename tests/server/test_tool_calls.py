"""Tool-call parsers (hermes, llama3_json): finished outputs, streamed outputs, forced-call
grammars; and tools rendered into a chat template exactly as transformers renders them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import llguidance
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvpilot.contract.serve_config import TOOL_CALL_PARSERS
from kvpilot.runtime.engine.grammar import to_llguidance
from kvpilot.runtime.server.chat_template import render_chat
from kvpilot.runtime.server.rendering import ToolCallStream
from kvpilot.runtime.server.request_models import ChatMessage
from kvpilot.runtime.server.tokenizing import message_dicts
from kvpilot.runtime.server.tool_calls import (
    PARSERS,
    ToolCall,
    call_head,
    forced_calls,
    parse,
    parser_name,
)

WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", '{"tz": "UTC"}')
HERMES = PARSERS["hermes"]
LLAMA = PARSERS["llama3_json"]

# (parser, output text, expected content, expected calls)
FINISHED: list[tuple[str, str, str | None, list[ToolCall]]] = [
    ("hermes", "Just text.", "Just text.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [WEATHER],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
        "Let me check.",
        [WEATHER, TIME],
    ),
    # the model ended (EOS) before closing the block: still a call, as vLLM reads it
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [TIME]),
    # cut off by max_tokens in a second call: the complete first call stands
    (
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"na',
        None,
        [TIME],
    ),
    # arguments given as a JSON string
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}',
        None,
        [TIME],
    ),
    # not well-formed: stays content, nothing is guessed
    (
        "hermes",
        "<tool_call>\n{not json}\n</tool_call>",
        "<tool_call>\n{not json}\n</tool_call>",
        [],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}',
        None,
        [WEATHER, TIME],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": ',
        '{"name": "get_weather", "parameters": {"city": ',
        [],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), FINISHED)
def test_finished_output(name: str, text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse(PARSERS[name], text) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), FINISHED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_output_equals_finished(
    name: str, text: str, content: str | None, calls: list[ToolCall], step: int
) -> None:
    """Streamed a few characters at a time: content deltas concatenate to the content, no part
    of a call marker is ever sent as content, and each call's pieces (the first with its id,
    type and name, the rest adding to the arguments) merge into the finished call."""
    stream = ToolCallStream(PARSERS[name])
    sent_content, merged = "", {}
    num_argument_pieces = 0
    for start in range(0, len(text), step):
        is_last = start + step >= len(text)
        delta, deltas = stream.add(text[start : start + step], is_last)
        sent_content += delta
        assert "<tool_call>" not in sent_content or not calls
        for piece in deltas:
            if piece.index not in merged:  # a call's first piece says what it is
                assert piece.id and piece.id.startswith("call_") and piece.type == "function"
                merged[piece.index] = ToolCall(piece.function.name or "", "")
            else:
                assert piece.id is None and piece.function.name is None
                num_argument_pieces += 1
            call = merged[piece.index]
            merged[piece.index] = ToolCall(
                call.name, call.arguments + (piece.function.arguments or "")
            )
    streamed = [merged[i] for i in sorted(merged)]
    if len(streamed) > len(calls):  # a last call cut off: sent as far as it went, then ended
        cut_off = streamed.pop()
        assert cut_off.arguments in text and not is_json(cut_off.arguments)
        content = text[: text.find(cut_off.name) - len('{"name": "')].strip() or None
    assert streamed == calls
    assert sent_content.strip() == (content or "").strip()
    if calls and step == 1 and re.search(r'"(arguments|parameters)": \{', text):
        # arguments written as an object stream as they come, not only at the end
        assert num_argument_pieces > 0


# A forced call's output (tool_choice required or named; compact, as its grammar writes it), cut
# off by max_tokens at any point: (parser, output text, expected calls). Never content.
HERMES_CALL = '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>'
LLAMA_CALL = '{"name":"get_time","parameters":{"tz":"UTC"}}'
FORCED: list[tuple[str, str, list[ToolCall]]] = [
    ("hermes", HERMES_CALL, [ToolCall("get_time", '{"tz":"UTC"}')]),
    ("hermes", HERMES_CALL[:51], [ToolCall("get_time", '{"tz":"U')]),
    ("hermes", '<tool_call>\n{"name":"get_time","arguments":', [ToolCall("get_time", "")]),
    ("hermes", '<tool_call>\n{"name":"get_ti', []),
    ("hermes", "<tool_ca", []),
    (
        "hermes",
        HERMES_CALL + "\n" + HERMES_CALL[:51],
        [ToolCall("get_time", '{"tz":"UTC"}'), ToolCall("get_time", '{"tz":"U')],
    ),
    ("llama3_json", LLAMA_CALL, [ToolCall("get_time", '{"tz":"UTC"}')]),
    ("llama3_json", LLAMA_CALL[:-3], [ToolCall("get_time", '{"tz":"UTC')]),
    ("llama3_json", LLAMA_CALL[:-1], [ToolCall("get_time", '{"tz":"UTC"}')]),
    ("llama3_json", '{"name":"get_time","parameters":', [ToolCall("get_time", "")]),
    ("llama3_json", '{"na', []),
    (
        "llama3_json",
        LLAMA_CALL + "; " + LLAMA_CALL[:-3],
        [ToolCall("get_time", '{"tz":"UTC"}'), ToolCall("get_time", '{"tz":"UTC')],
    ),
]


@pytest.mark.parametrize(("name", "text", "calls"), FORCED)
def test_forced_output_cut_off_is_the_calls_so_far(
    name: str, text: str, calls: list[ToolCall]
) -> None:
    """vLLM's `length` with the partial call: the complete calls, then the cut one as far as
    it was written once its name is; the raw text is never content (issue 40 item 15)."""
    assert forced_calls(PARSERS[name], text) == calls


@pytest.mark.parametrize(("name", "text", "calls"), FORCED)
@pytest.mark.parametrize("step", [1, 4])
def test_forced_stream_sends_what_the_response_gives(
    name: str, text: str, calls: list[ToolCall], step: int
) -> None:
    stream = ToolCallStream(PARSERS[name], is_forced=True)
    merged: dict[int, ToolCall] = {}
    for start in range(0, len(text), step):
        content, deltas = stream.add(text[start : start + step], start + step >= len(text))
        assert not content
        for piece in deltas:
            call = merged.get(piece.index, ToolCall(piece.function.name or "", ""))
            merged[piece.index] = ToolCall(
                call.name, call.arguments + (piece.function.arguments or "")
            )
    assert [merged[i] for i in sorted(merged)] == calls


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_call_head_follows_arguments_as_written() -> None:
    body = '{"name": "get_weather", "arguments": {"city": "P\\"a}r'
    assert call_head(body) == ("get_weather", '{"city": "P\\"a}r')
    assert call_head(body + 'is"}}') == ("get_weather", '{"city": "P\\"a}ris"}')
    assert call_head('{"arguments": {}, "name": "f"}') is None  # name not first: sent whole
    assert call_head('{"name": "f", "arguments": "{}"}') is None  # not an object


FUNCTIONS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
    {"name": "get_time"},  # no parameters: any object
]


@pytest.mark.parametrize(
    ("name", "is_parallel", "text", "is_accepted"),
    [
        (
            "hermes",
            False,
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
            True,
        ),
        ("hermes", False, '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>', True),
        (
            "hermes",
            False,
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>',
            False,
        ),
        ("hermes", False, '<tool_call>\n{"name":"nope","arguments":{}}\n</tool_call>', False),
        (
            "hermes",
            False,
            'Sure! <tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
            False,
        ),
        (
            "hermes",
            True,
            '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
            True,
        ),
        (
            "hermes",
            False,
            '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
            False,
        ),
        ("llama3_json", False, '{"name":"get_weather","parameters":{"city":"Paris"}}', True),
        ("llama3_json", False, '{"name":"get_weather","arguments":{"city":"Paris"}}', False),
        (
            "llama3_json",
            True,
            '{"name":"get_time","parameters":{}}; {"name":"get_time","parameters":{}}',
            True,
        ),
    ],
)
def test_forced_call_grammar(name: str, is_parallel: bool, text: str, is_accepted: bool) -> None:
    """The grammar for tool_choice required/named admits exactly the calls the parser reads."""
    tokenizer = llguidance.LLTokenizer(
        str(Path(__file__).parents[2] / "models/tiny-llama/tokenizer.json")
    )
    spec = PARSERS[name].grammar(FUNCTIONS, is_parallel)
    matcher = llguidance.LLMatcher(tokenizer, to_llguidance(spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    data = text.encode()
    tokens = tokenizer.tokenize_bytes(data)
    consumed = matcher.try_consume_tokens(tokens)
    assert (consumed == len(tokens) and matcher.is_accepting()) == is_accepted
    if is_accepted:
        assert parse(PARSERS[name], text)[1]


@pytest.mark.parametrize(
    ("configured", "architecture", "expected"),
    [
        ("auto", "LlamaForCausalLM", "llama3_json"),
        ("auto", "Qwen2ForCausalLM", "hermes"),
        ("auto", "SomethingNew", "hermes"),
        ("hermes", "LlamaForCausalLM", "hermes"),
    ],
)
def test_parser_from_flag_and_architecture(
    configured: str, architecture: str, expected: str
) -> None:
    assert parser_name(configured, architecture) == expected


# A Hermes/Qwen-style template (written for this test): tools in the system turn, assistant
# tool calls with `| tojson` arguments, tool results as their own turns.
TOOL_TEMPLATE = """{% if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{% for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}{% if message.role == 'tool' %}(for {{ message.tool_call_id }}){% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tools_and_tool_messages_render_as_in_transformers(tmp_path: Path) -> None:
    tools: list[dict[str, Any]] = [{"type": "function", "function": FUNCTIONS[0]}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    # What the server hands the template: the OpenAI message with its arguments as an object.
    ours = render_chat(
        TOOL_TEMPLATE, message_dicts([ChatMessage.model_validate(m) for m in messages]), tools=tools
    )
    # transformers, given the arguments as an object, as its chat-template docs ask
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected = hf_tokenizer(tmp_path).apply_chat_template(
        hf_messages, tools=list[Any](tools), tokenize=False, add_generation_prompt=True
    )
    assert ours == expected
    assert '"arguments": {"city": "Paris"}' in ours and "get_weather" in ours.split("<|im_end|>")[0]


def hf_tokenizer(tmp_path: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"unk_token": "<unk>", "chat_template": TOOL_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return PreTrainedTokenizerFast.from_pretrained(str(tmp_path))


def test_the_flag_offers_exactly_the_parsers_there_are() -> None:
    # --tool-call-parser's choices live in the contract (the operator writes the flag); the
    # parsers live here: a parser added on one side only is a flag that fails or a parser unused.
    assert set(TOOL_CALL_PARSERS) == {"auto", *PARSERS}
