"""Checks every request body gets: the table of OpenAI/vLLM fields this runtime does not honour
(a 400 naming the field when one asks for something), text that is not valid Unicode, and the
400 message and param of a pydantic/FastAPI validation error (server/request_models.py's models use
them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from pydantic_core import PydanticCustomError

# Arrays and objects a body may nest: far more than any request needs (a JSON schema of 30
# nested objects, chat content parts), far less than the recursion of the code that walks them
# (schema compilation, chat templates), which would fail with RecursionError, a 500.
MAX_JSON_DEPTH = 100

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


def find_unencodable(value: Any, path: str) -> str | None:
    """The path (e.g. 'messages.0.content') of the first string in a JSON value that cannot be
    encoded as UTF-8, or None. JSON's "\\ud800" escape decodes to such a string in Python."""
    for where, key, item in walk(value, path):
        if isinstance(key, str) and not _is_encodable(key):
            return where
        if isinstance(item, str) and not _is_encodable(item):
            return where
    return None


def find_too_deep(value: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """The top-level field holding an array or object nested deeper than `max_depth` levels (its
    whole path would be as long as the nesting), or None."""
    deep = next((where for where, _, _, depth in _walk(value, "") if depth > max_depth), None)
    return None if deep is None else deep.split(".", 1)[0]


def walk(value: Any, path: str) -> Iterator[tuple[str, object, Any]]:
    """(path, key, value) of `value` and of everything in it, depth first, in document order."""
    return ((where, key, item) for where, key, item, _ in _walk(value, path))


def _walk(value: Any, path: str) -> Iterator[tuple[str, object, Any, int]]:
    """`walk` with each value's depth (arrays and objects holding it), without recursion: a body
    may nest as deep as json.loads allows, deeper than Python's stack."""
    stack: list[tuple[str, object, Any, int]] = [(path, None, value, 0)]
    while stack:
        where, key, item, depth = stack.pop()
        yield where, key, item, depth
        if isinstance(item, dict):
            children: Iterable[tuple[Any, Any]] = item.items()
        elif isinstance(item, list) and item and not isinstance(item[0], int):
            children = enumerate(item)  # a list of token ids is skipped whole: it has no text
        else:
            continue
        below = [(f"{where}.{k}" if where else str(k), k, v, depth + 1) for k, v in children]
        stack.extend(reversed(below))


def _is_encodable(text: str) -> bool:
    if text.isascii():  # the common case, without copying the text
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def describe_validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for the first pydantic/FastAPI error, naming the field as OpenAI does."""
    if not errors:
        return "invalid request", None
    first = most_specific(errors)
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


def most_specific(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The first error; where that is one member of a union failing (its loc names the member)
    and one member got deeper into the input than the others, that member's first error: the
    member the input was shaped like tells more ("content.1.type: Input should be 'text'" for
    an image part) than the first one tried ("content: Input should be a valid string"). Where
    members tie (a prompt mixing text and ids) none is the one meant: the first error stays."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    member_at = next((i for i, part in enumerate(loc) if _is_type_name(part)), None)
    if member_at is None:
        return first

    def is_member_error(error: Mapping[str, Any]) -> bool:
        other = [str(part) for part in error.get("loc", ())]
        same_union = other[:member_at] == loc[:member_at] and len(other) > member_at
        return same_union and _is_type_name(other[member_at])

    members = [e for e in errors if is_member_error(e)]
    deepest = max(len(e.get("loc", ())) for e in members)
    at_depth = [e for e in members if len(e.get("loc", ())) == deepest]
    if len({str(e["loc"][member_at]) for e in at_depth}) > 1:
        return first
    return at_depth[0]


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or "[" in part or part.startswith("function-")
