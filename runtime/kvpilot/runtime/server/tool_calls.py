"""Tool calls in a model family's own format (pure Python): parse them out of the output text,
and write the grammar that forces a call when `tool_choice` is `required` or a named function.

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, after any plain text.
- llama3_json (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, several
  separated by `;` (`"arguments"` accepted too, as vLLM does).

A parser never guesses: output that is not well-formed calls stays plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.runtime.engine.structured import GrammarSpec, strict_schema

# The format each architecture's instruction-tuned checkpoints were trained on.
PARSER_BY_ARCHITECTURE = {
    "LlamaForCausalLM": "llama3_json",
    "MistralForCausalLM": "hermes",
    "Qwen2ForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# llguidance's per-schema options inside a Lark grammar: compact JSON, as for response formats
# (grammar.JSON_OPTIONS), so a weak model cannot fill a forced call with blanks.
COMPACT_JSON = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCallParser(Protocol):
    def content_end(self, text: str) -> int:
        """How much of `text` (a prefix of the output) is plain content for sure: what follows
        may be, or may become, a tool call."""
        ...

    def calls(self, tail: str, is_finished: bool) -> list[ToolCall] | None:
        """The complete calls in `tail` (the output from `content_end` on); None when the tail
        is not well-formed calls (then, once finished, it is content after all)."""
        ...

    def pending(self, tail: str) -> str | None:
        """The text of the call being written after the complete ones in `tail`, if any."""
        ...

    def grammar(self, functions: list[dict[str, Any]], is_parallel: bool) -> GrammarSpec:
        """A grammar that admits only calls of `functions` (OpenAI function definitions); its
        source is `tools`, whose parameter schemas are what can fail to compile."""
        ...


def parse(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output; content None when the output is only calls."""
    end = parser.content_end(text)
    calls = parser.calls(text[end:], is_finished=True) if end < len(text) else []
    if not calls:
        return text, []
    return (text[:end].strip() or None), calls


def forced_calls(parser: ToolCallParser, text: str) -> list[ToolCall]:
    """The calls of an output whose grammar admits only calls (tool_choice `required` or a
    named function), the last one as far as it was written when the output was cut off
    (max_tokens): its name and its arguments so far, not valid JSON. None is cut off before its
    name is complete. Never content: the text is calls or the start of one."""
    tail = text[parser.content_end(text) :]
    calls = parser.calls(tail, is_finished=False) or []
    pending = parser.pending(tail)
    cut = cut_call(pending) if pending else None
    return [*calls, cut] if cut else calls


def parser_name(configured: str, architecture: str) -> str:
    """The `--tool-call-parser` flag, `auto` resolved from the checkpoint's architecture."""
    if configured != "auto":
        return configured
    return PARSER_BY_ARCHITECTURE.get(architecture, "hermes")


def call_schema(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """A JSON schema for one call of any of `functions`: the name, then its arguments, under
    the function's parameters read strictly (structured.strict_schema): OpenAI's strict function
    calling, and what lets a weak model close the object."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                arguments_key: strict_schema(f.get("parameters") or ANY_OBJECT),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return {**COMPACT_JSON, **(options[0] if len(options) == 1 else {"anyOf": options})}


# A call that names its function first: `{"name": "...", "arguments": ` (or "parameters").
CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array that begins at text[start], or None while it is
    still open (a bracket-and-string scan; the value is checked by json.loads elsewhere)."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def call_head(body: str) -> tuple[str, str] | None:
    """(name, the arguments object written so far) of a call that names its function first and
    whose arguments are an object; None before that is known. Streamed calls use it, so the
    arguments stream as the model writes them."""
    match = CALL_HEAD.match(body)
    if match is None or not body.startswith("{", match.end()):
        return None
    try:
        name = json.loads(f'"{match.group(1)}"')
    except json.JSONDecodeError:
        return None
    end = json_value_end(body, match.end())
    return name, body[match.end() : end]


def cut_call(body: str) -> ToolCall | None:
    """The call being written in `body` as far as it goes: its name and the arguments written
    so far ("" before they begin); None before the name is complete."""
    head = call_head(body)
    if head is not None:
        return ToolCall(*head)
    match = CALL_HEAD.match(body)
    if match is None or body[match.end() :]:
        return None  # no name yet, or arguments that are not an object (not a forced call)
    try:
        return ToolCall(json.loads(f'"{match.group(1)}"'), "")
    except json.JSONDecodeError:
        return None


def _call_from_text(body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A well-formed call; its arguments as the model wrote them when the name came first (what
    a stream sent), else re-serialised."""
    try:
        call = _call_from(json.loads(body), argument_keys)
    except json.JSONDecodeError:
        return None
    head = call_head(body)
    if call is not None and head is not None and head[0] == call.name:
        return ToolCall(call.name, head[1])
    return call


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = obj.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - held_back(text, self.START)

    def calls(self, tail: str, is_finished: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for match in self.BLOCK.finditer(tail):
            is_closed = match.group(0).endswith(self.END)
            if not is_closed and not is_finished:
                break  # still being written
            call = _call_from_text(match.group(1), ("arguments", "parameters"))
            if call is None and not is_closed and calls:
                break  # a last call cut off (max_tokens): the complete ones stand
            if call is None:
                return None
            calls.append(call)
        return calls

    def pending(self, tail: str) -> str | None:
        blocks = list(self.BLOCK.finditer(tail))
        is_open = blocks and not blocks[-1].group(0).endswith(self.END)
        return blocks[-1].group(1) if is_open else None

    def grammar(self, functions: list[dict[str, Any]], is_parallel: bool) -> GrammarSpec:
        schema = json.dumps(call_schema(functions, "arguments"), ensure_ascii=False)
        repeat = ' ("\\n" call)*' if is_parallel else ""
        lark = (
            f"start: call{repeat}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {schema}\n"
        )
        return GrammarSpec("lark", lark, "tools")


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.PYTHON_TAG.startswith(stripped[: len(self.PYTHON_TAG)]):
            return len(text) - len(stripped)  # nothing yet, or the start of a call
        return len(text) - len(stripped) if stripped.startswith("{") else len(text)

    def calls(self, tail: str, is_finished: bool) -> list[ToolCall] | None:
        calls, rest = self._complete(tail)
        if calls is None or (rest and is_finished):
            return None
        return calls

    def pending(self, tail: str) -> str | None:
        calls, rest = self._complete(tail)
        return rest if calls is not None and rest else None

    def _complete(self, tail: str) -> tuple[list[ToolCall] | None, str]:
        """(the complete calls, the text after them); None for text that is not calls."""
        text = tail.strip().removeprefix(self.PYTHON_TAG)
        decoder, pos = json.JSONDecoder(), 0
        calls: list[ToolCall] = []
        while pos < len(text):
            try:
                _, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return calls, text[pos:]  # incomplete (or not JSON: decided once finished)
            call = _call_from_text(text[pos:end], ("parameters", "arguments"))
            if call is None:
                return None, ""
            calls.append(call)
            pos = _skip_separator(text, end)
        return calls, ""

    def grammar(self, functions: list[dict[str, Any]], is_parallel: bool) -> GrammarSpec:
        schema = json.dumps(call_schema(functions, "parameters"), ensure_ascii=False)
        repeat = ' ("; " call)*' if is_parallel else ""
        return GrammarSpec("lark", f"start: call{repeat}\ncall: %json {schema}\n", "tools")


def _skip_separator(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n;":
        pos += 1
    return pos


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
