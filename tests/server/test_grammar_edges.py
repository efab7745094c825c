"""Where constraints meet, through a real server and the official openai client:

- `tool_choice: "none"` forbids calls but does not hide the tools: the chat template still
  renders them (as vLLM does), and call-shaped text stays content.
- A grammar and `min_tokens`: the grammar wins. A sequence ends when its grammar is complete
  even before min_tokens (there is no valid token to add); while the grammar can go on, EOS
  stays masked until min_tokens, as without a grammar.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow

# tiny-llama's own template ignores tools; this one writes them before the conversation, as the
# templates of tool-trained checkpoints do.
TOOLS_TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CLOCK: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}},
    },
}
MESSAGES: Any = [{"role": "user", "content": "What time is it?"}]
# A llama3_json call (tiny-llama is a Llama), forced with a regex so that the model writes it.
CALL_TEXT = '{"name": "get_time", "parameters": {"tz": "UTC"}}'


def with_tools_template(root: Path) -> Path:
    """tiny-llama with TOOLS_TEMPLATE as its chat template (the weights linked, not copied)."""
    for item in TINY.iterdir():
        if item.suffix == ".safetensors":
            (root / item.name).symlink_to(item)
        else:
            shutil.copy(item, root / item.name)
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def client(
    start_server: Callable[..., RuntimeServer], tmp_path_factory: pytest.TempPathFactory
) -> OpenAI:
    model = with_tools_template(tmp_path_factory.mktemp("tools-template"))
    server = start_server("--model", str(model), "--max-model-len", "512")
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def prompt_tokens(client: OpenAI, **kwargs: Any) -> int:
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **kwargs)
    assert answer.usage is not None
    return answer.usage.prompt_tokens


def test_tool_choice_none_still_renders_the_tools(client: OpenAI) -> None:
    without = prompt_tokens(client)
    auto = prompt_tokens(client, tools=[CLOCK], tool_choice="auto")
    none = prompt_tokens(client, tools=[CLOCK], tool_choice="none")
    assert none == auto > without + 10  # the tool's JSON is in the prompt either way


@pytest.mark.parametrize(("tool_choice", "is_call"), [("auto", True), ("none", False)])
def test_tool_choice_none_leaves_call_shaped_text_as_content(
    client: OpenAI, tool_choice: Any, is_call: bool
) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[CLOCK],
        tool_choice=tool_choice,
        max_tokens=40,
        extra_body={"guided_regex": re.escape(CALL_TEXT)},
    )
    message = answer.choices[0].message
    if is_call:
        assert message.tool_calls and not message.content
        function = message.tool_calls[0].function  # type: ignore[union-attr]
        assert (function.name, json.loads(function.arguments)) == ("get_time", {"tz": "UTC"})
        assert answer.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content == CALL_TEXT and not message.tool_calls
        assert answer.choices[0].finish_reason == "stop"


def test_a_complete_grammar_ends_the_sequence_before_min_tokens(client: OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL,
        prompt="Say yes:",
        max_tokens=20,
        extra_body={"guided_choice": ["yes"], "min_tokens": 10},
    )
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason) == ("yes", "stop")
    assert answer.usage is not None and answer.usage.completion_tokens < 10


def test_min_tokens_holds_while_the_grammar_can_go_on(client: OpenAI) -> None:
    for seed in range(3):
        answer = client.completions.create(
            model=MODEL,
            prompt="Letters:",
            max_tokens=20,
            seed=seed,
            extra_body={"guided_regex": "(ab)+", "min_tokens": 7},
        )
        choice = answer.choices[0]
        assert re.fullmatch("(ab)+a?", choice.text), choice.text  # `length` may cut an ab
        assert answer.usage is not None and answer.usage.completion_tokens >= 7
